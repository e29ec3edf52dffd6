"""Weights as the programs take them: the stored forms of quantized weights (stored.py, a leaf
every other module may import) and the numpy arithmetic that makes and reads them (quantize.py)."""
