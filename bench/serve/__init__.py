"""`python -m bench.serve`: kept for old command lines; the serving benchmark lives in `servebench/` (a package the
`kdamesh` command line may import, which `bench/` may not be)."""
