"""Finding a method's parameters on a model: the evolutionary search of a position map (search,
`rope-ext search`) over its spaces (search_space), and DPE's probe of each dimension group's
effective distance (dpe_probe, `rope-ext dpe-probe`)."""
