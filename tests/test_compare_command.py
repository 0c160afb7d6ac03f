"""The `Command:` line bench.compare writes at the top of results.md must paste back into a shell as the
same arguments: run-config strings hold single-quoted values (`partition='classes-per-site'`)."""

import shlex

from hypothesis import given
from hypothesis import strategies as st

from bench.compare import shell_quote


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40))
def test_a_quoted_argument_splits_back_into_itself(argument):
    assert shlex.split(shell_quote(argument)) == [argument]


def test_a_run_config_with_single_quoted_values_stays_readable():
    spec = "factory-dp-z1:factory:factory.dp-noise-multiplier=1.0 partition='classes-per-site'"
    assert shell_quote(spec) == f'"{spec}"'
