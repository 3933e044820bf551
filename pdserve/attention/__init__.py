"""Attention behind one seam: an interface, one backend per kernel family, a start-up factory.

The model hands each layer's rotated queries and new K/V to the backend and never asks which
device it runs on (see :mod:`pdserve.attention.backend`).
"""
