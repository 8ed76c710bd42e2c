"""The cost model: what one layout costs in time and memory, from layer costs, devices and links."""
