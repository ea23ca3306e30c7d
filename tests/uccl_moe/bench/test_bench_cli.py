"""`uccl-moe bench` is registered and takes the bench flags."""

from helpers.requires import require

require("omegaconf")

from uccl_moe import cli


def test_bench_subcommand_parses_bench_flags():
    parser = cli.build_parser()
    assert "bench" in cli.registered()
    args = parser.parse_args(["bench", "--ranks", "2", "--tokens", "128,4096", "--dtypes", "fp8", "--iters", "25"])
    assert args.ranks == 2 and args.tokens == [128, 4096] and args.dtypes == "fp8" and args.iters == 25
