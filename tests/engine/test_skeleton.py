import torch

from leanlm.engine import skeleton


def test_a_helper_gets_every_tensor_empty_with_its_shape_strides_dtype_and_sharing(tmp_path):
    """The helper saves what it got (torch.save, run there): the same shapes, strides, dtypes and Parameter kinds, a
    tensor reached twice still one tensor, and no value copied."""
    tied = torch.nn.Parameter(torch.full((3, 4), 7.0), requires_grad=False)
    sent = {"tied": tied, "again": tied, "t": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
            "codes": torch.ones(5, dtype=torch.uint8), "text": "kept"}
    helper = skeleton.Helper(torch.save, sent, str(tmp_path / "got.pt"))
    assert helper.wait(timeout=120) == ""
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert got["text"] == "kept" and isinstance(got["tied"], torch.nn.Parameter)
    assert got["tied"] is got["again"] or got["tied"].data_ptr() == got["again"].data_ptr()
    for name in ("tied", "t", "codes"):
        assert (got[name].shape, got[name].stride(), got[name].dtype) == (sent[name].shape, sent[name].stride(),
                                                                           sent[name].dtype)
    assert not torch.equal(got["t"], sent["t"]) or not torch.equal(got["tied"], sent["tied"])  # values not sent


def test_a_failed_helper_says_why():
    assert "invalid literal" in skeleton.Helper(int, "not a number").wait(timeout=120)
