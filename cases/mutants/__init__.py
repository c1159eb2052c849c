"""The mutant catalogue: realistic broken SP implementations the default suite must kill."""
