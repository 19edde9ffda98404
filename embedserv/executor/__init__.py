"""Worker processes, their IPC and data parallelism."""
