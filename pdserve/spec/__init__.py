"""Speculative decoding that changes no token: proposers draft, the target verifies exactly.

See docs/architecture.md, "Speculative decoding": the verify step scores each drafted position
as a row of a prompt chunk over the sequence's cached prefix, which pdserve's CPU kernels compute
bit for bit as the plain decode step at that position would, and the sampler's noise is a pure
function of (seed, position, token id); a draft token is kept iff it is the token the plain step
would have sampled, so the stream is the plain stream.
"""
