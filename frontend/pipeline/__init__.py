"""The pipeline every face shares: request -> prompt -> engine parameters -> jobs -> frames
(`pipeline.py` is the spine).
"""
