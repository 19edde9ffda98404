"""`embedserv batch`: a corpus file embedded offline, with progress and resume (command.py), and a Ray Data
callable for many machines (ray_data.py)."""
