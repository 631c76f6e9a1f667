"""What a run shows and keeps: the terminal and run log, metrics and artifacts, eval metrics, profiles,
the run directory's lock and owner record, and the local Prefect server.
"""
