"""Which fabric NIXL's UCX may use: RDMA where the host has a device, and only there are UCX's
InfiniBand modules allowed to load (issue 37 item 2)."""

from __future__ import annotations

from kvd.cluster.nixl_transport import NO_RDMA_MODULES, fabric, keep_rdma_modules_out_without_a_device, rdma_devices


def test_a_host_with_an_rdma_device_uses_it_unless_the_operator_excluded_it(tmp_path):
    devices = tmp_path / "infiniband"
    devices.mkdir()
    assert rdma_devices(devices) == [] and fabric(devices, {}) == "tcp"
    (devices / "mlx5_0").mkdir()
    (devices / "rocep1s0").mkdir()
    assert rdma_devices(devices) == ["mlx5_0", "rocep1s0"]
    assert fabric(devices, {}) == "rdma"
    assert fabric(devices, {"UCX_MODULES": NO_RDMA_MODULES}) == "tcp"
    assert fabric(devices, {"UCX_MODULES": "^cuda"}) == "rdma"


def test_a_host_without_the_class_directory_has_no_rdma(tmp_path):
    assert rdma_devices(tmp_path / "absent") == [] and fabric(tmp_path / "absent", {}) == "tcp"


def test_ucx_s_infiniband_modules_are_kept_out_only_where_there_is_no_device(tmp_path):
    without, set_by_operator, with_device = {}, {"UCX_MODULES": "^cuda"}, {}
    keep_rdma_modules_out_without_a_device(tmp_path / "absent", without)
    keep_rdma_modules_out_without_a_device(tmp_path / "absent", set_by_operator)
    (tmp_path / "infiniband" / "mlx5_0").mkdir(parents=True)
    keep_rdma_modules_out_without_a_device(tmp_path / "infiniband", with_device)
    assert without == {"UCX_MODULES": NO_RDMA_MODULES}
    assert set_by_operator == {"UCX_MODULES": "^cuda"} and with_device == {}
