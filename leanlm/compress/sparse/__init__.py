"""Pruning: masks (unstructured, N:M), magnitude, Wanda, SparseGPT, Taylor saliency, structured pruning."""
