"""Weights from trainers to inference copies: the routes planned at launch and the collective transfer.
"""
