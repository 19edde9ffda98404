"""Schedulers: pure Python, no torch. They decide what runs next; workers decide nothing."""
