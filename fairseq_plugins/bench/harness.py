def add_bench_parser(subparsers):
    pass
