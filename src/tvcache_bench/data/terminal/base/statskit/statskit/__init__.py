from .core import mean, median, mode, quantile, stdev, variance

__all__ = ["mean", "median", "mode", "quantile", "stdev", "variance"]
