"""Plots of a finished (or failed) run read back from its run directory; ``python -m rlfw.report`` draws them.

``load`` reads the run files, ``figures`` draws them with matplotlib (Agg), ``summary`` tabulates a sweep.
"""
