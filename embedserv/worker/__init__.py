"""The device side: packs a scheduled batch, runs the model inside the forward context, pools."""
