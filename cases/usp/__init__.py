"""usp-gpt: the Ulysses x ring hybrid ("USP", yunchang / TransformerEngine's a2a+p2p); usp/cases.py."""
