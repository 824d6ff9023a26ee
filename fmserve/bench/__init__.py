"""The benchmarks behind `fmserve bench offline|serve|spec|prefix|peers`."""
