"""A start that fits a unified-memory box (U1-U11): the verdict on a start's figures
(`startfit.py`) and what it says (`fitsay.py`)."""
