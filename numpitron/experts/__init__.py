"""A mixture of experts (Shazeer et al. 2017; Fedus et al. 2021; DeepSeek-V3): the router, the
local experts, the all-to-all dispatch, and the routing log. Chapter 13 of the book opens this folder."""
