"""The model-consistency message (single process; the collective check is in test_model_mismatch.py)."""

from mpisolve.comm.state import describe_mismatch


def test_names_first_mismatching_parameter_and_ranks():
    ref = [("a.weight", (3, 4), "float32"), ("a.bias", (3,), "float32")]
    other = [("a.weight", (3, 5), "float32"), ("a.bias", (3,), "float32")]
    msg = describe_mismatch([ref, ref, other, other])
    assert "'a.weight'" in msg and "rank(s) 2,3" in msg and "[3, 5]" in msg and "[3, 4]" in msg


def test_names_missing_parameters():
    ref = [("w", (1,), "float32")]
    msg = describe_mismatch([ref, ref + [("extra", (2,), "float64")]])
    assert "'extra'" in msg and "rank(s) 1" in msg and "no such parameter" in msg


def test_dtype_mismatch():
    msg = describe_mismatch([[("w", (2,), "float32")], [("w", (2,), "float64")]])
    assert "float64" in msg and "rank(s) 1" in msg
