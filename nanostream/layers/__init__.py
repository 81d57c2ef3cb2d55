"""Building blocks of the models: attention over the paged cache, norms, rotary embedding, linears."""
