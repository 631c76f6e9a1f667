"""Calling a run's processes and waiting for them: replica calls and what a flow's call sends (dispatch), the
stage clock (deadline and stop check), the order a stage sends its calls in, stopping on a signal, and what a
lost process means.
"""
