"""Calling a run's processes and waiting for them: the run handle and replica calls, the stage clock
(deadline and stop check), stopping on a signal, and what a lost process means.
"""
