"""The mutant catalogue: realistic broken SP implementations the default suite must kill. Each
module registers its mutants (scaled_mutants: sensitivity probes, tagged 'scaled': not in the
battery); sp_harness.cases.BUILTIN names them."""
