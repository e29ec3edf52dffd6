"""The PyHLO op library: small functions over HloValues, one theme per module."""
