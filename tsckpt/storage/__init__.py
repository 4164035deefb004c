"""Where checkpoint bytes live and how they move: locations, contexts, kvstores, array specs, layouts."""
