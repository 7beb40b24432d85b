"""Drive kvd's SGLang backend through SGLang's hybrid cache controller, on the CPU: a model with
sliding-window layers ("swa") or Mamba layers ("mamba") beside full attention.

Run with .venv-sglang's python (tests/engines/test_sglang_hybrid.py does), with a JSON list of steps:

    sglang_hybrid_harness.py '[{"op": "write", "kind": "swa", "target": "unix:///.../kvd.sock", "seed": 1}]'

Each step builds SGLang's real device pools (SWAKVPool, or HybridLinearKVPool with a MambaPool),
their host pools in a HostPoolGroup, and a HybridCacheController that attaches kvd through SGLang's
"dynamic" factory, as SGLang 0.5.23 does for every model.

- write: fills the KV host pages of a prompt and the extra pool's pages for its end (the last
  `window` pages of the sliding-window layers, or the Mamba state) with seeded random bytes, and
  hands them to the controller's write-back (write_storage -> batch_set_v2 and batch_set_v1);
  with "no_state", the KV pages only. A prompt's first pages do not depend on its length.
- read: in fresh pools, asks the controller to prefetch the prompt (batch_exists_v2), then plays
  the scheduler (host pages for the hit, the I/O thread -> batch_get_v2 and batch_get_v1) and
  compares every loaded page with the seeded bytes.

The last stdout line, "HARNESS-RESULT [...]", holds one JSON object per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_harness  # noqa: E402  (stubs torchvision before sglang is imported)
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

PAGE, DTYPE, LAYERS = 16, torch.bfloat16, 4
TIMEOUT_S = 60.0


def mha_host(device_pool, label: str) -> MHATokenToKVPoolHost:
    return MHATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "layer_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=device_pool.size,
                                start_layer=device_pool.start_layer, end_layer=device_pool.end_layer,
                                write_back_staging=device_pool.hicache_write_back_staging, pool_label=label)


def swa_pools():
    """Layers 0 and 2 sliding-window, 1 and 3 full: (allocator, group, KV host pool, SWA host pool)."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    device = SWAKVPool(size=1024, size_swa=512, page_size=PAGE, dtype=DTYPE, head_num=2, head_dim=64,
                       swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu",
                       enable_memory_saver=False)
    allocator = SWATokenToKVPoolAllocator(1024, 512, PAGE, DTYPE, "cpu", device, need_sort=False)
    full = {layer: local for layer, (local, swa) in device.layers_mapping.items() if not swa}
    windowed = {layer: local for layer, (local, swa) in device.layers_mapping.items() if swa}
    kv, swa = mha_host(device.full_kv_pool, "full"), mha_host(device.swa_kv_pool, "swa")
    group = HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=kv, device_pool=device.full_kv_pool, layer_mapping=full,
                         transfer_layer_id_max=LAYERS, is_anchor=True),
        build_pool_entry(name=PoolName.SWA, host_pool=swa, device_pool=device.swa_kv_pool, layer_mapping=windowed,
                         transfer_layer_id_max=LAYERS, device_alloc_fn=allocator.swa_attn_allocator.alloc,
                         device_free_fn=allocator.swa_attn_allocator.free)])
    return allocator, group, kv, swa


def mamba_pools():
    """Layers 0 and 2 Mamba2, 1 and 3 full: (allocator, group, KV host pool, Mamba host pool)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=128, n_groups=1, num_heads=4, head_dim=32,
                                    state_size=16, conv_kernel=4)
    params = Mamba2CacheParams(shape=shape, layers=[0, 2],
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    states = MambaPool(size=8, spec_state_size=0, cache_params=params, mamba_layer_ids=[0, 2], device="cpu")
    device = HybridLinearKVPool(size=1024, dtype=DTYPE, page_size=PAGE, head_num=2, head_dim=64,
                                full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=states)
    allocator = PagedTokenToKVPoolAllocator(1024, PAGE, DTYPE, "cpu", device, False)
    full = device.full_kv_pool
    kv = MHATokenToKVPoolHost(full.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first_direct",
                              pin_memory=False, device="cpu", device_capacity_tokens=full.size,
                              start_layer=full.start_layer, end_layer=full.end_layer,
                              write_back_staging=full.hicache_write_back_staging)
    (info,) = states.get_device_pool_infos()
    mamba = MambaPoolHost(info.buffer_info, 2.0, 0, device_capacity=states.size, pin_memory=False, device="cpu",
                          layout="page_first_direct")
    group = HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=kv, device_pool=full, layer_mapping={1: 0, 3: 1},
                         transfer_layer_id_max=LAYERS, is_anchor=True),
        build_pool_entry(name=PoolName.MAMBA, host_pool=mamba, device_pool=states, layer_mapping={0: 0, 2: 1},
                         transfer_layer_id_max=LAYERS)])
    return allocator, group, kv, mamba


def build(args: argparse.Namespace):
    layout = "layer_first" if args.kind == "swa" else "page_first_direct"
    sglang_harness.publish_server_args(PAGE, None, hicache_mem_layout=layout, hicache_io_backend="direct")
    allocator, group, kv, extra = swa_pools() if args.kind == "swa" else mamba_pools()
    config = {"backend_name": "kvd", "module_path": "kvd.connectors.sglang", "class_name": "KvdHiCacheStorage",
              "interface_v1": 1, "target": args.target, "namespace": args.namespace}
    controller = HybridCacheController(allocator, group, PAGE, None, threading.Event(), write_policy="write_through",
                                       io_backend="direct", storage_backend="dynamic", prefetch_threshold=PAGE,
                                       model_name="kvd-hybrid-test", storage_backend_extra_config=config,
                                       transfer_layer_id_max=LAYERS)
    return controller, kv, extra


def seeded_pages(host_pool, count: int, seed: int) -> list[torch.Tensor]:
    """`count` flat pages of random values for this pool, from the seed."""
    generator = torch.Generator().manual_seed(seed)
    dummy = host_pool.get_dummy_flat_data_page()
    if dummy.dtype == torch.uint8:
        return [torch.randint(0, 256, dummy.shape, generator=generator, dtype=torch.uint8) for _ in range(count)]
    return [torch.randn(dummy.shape, generator=generator).to(dummy.dtype) for _ in range(count)]


def prompt(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, 32000, (args.pages * PAGE,), generator=generator).tolist()
    return tokens, get_storage_hash_str(tokens, None, page_size=PAGE)


def extra_name(args: argparse.Namespace) -> PoolName:
    return PoolName.SWA if args.kind == "swa" else PoolName.MAMBA


def run_write(args: argparse.Namespace) -> dict:
    controller, kv, extra = build(args)
    tokens, hashes = prompt(args)
    kv_indices = kv.alloc(args.pages * PAGE)
    extra_indices = extra.alloc(args.window * extra.page_size)
    for index, page in enumerate(seeded_pages(kv, args.pages, args.seed)):
        kv.set_from_flat_data_page(int(kv_indices[index * PAGE]), page)
    for index, page in enumerate(seeded_pages(extra, args.window, args.seed + 100)):
        extra.set_from_flat_data_page(int(extra_indices[index * extra.page_size]), page)
    transfer = PoolTransfer(name=extra_name(args), host_indices=extra_indices, keys=hashes[-args.window:],
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)
    operation_id = controller.write_storage(kv_indices, tokens, hash_value=hashes, prefix_keys=[],
                                            extra_pools=None if args.no_state else [transfer])
    completed = sglang_harness.wait_backup(controller, operation_id)
    controller.detach_storage_backend()
    return {"completed_tokens": completed, "tokens": len(tokens)}


def run_read(args: argparse.Namespace) -> dict:
    controller, kv, extra = build(args)
    tokens, _ = prompt(args)
    placeholders = PoolTransfer(name=extra_name(args), keys=["__placeholder__"] * args.window,
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
    controller.prefetch(CacheRequestHandle("req-0", 0), tokens, None, [], extra_pools=[placeholders])
    operation = controller.prefetch_hit_queue.get(timeout=TIMEOUT_S)
    result = {"tokens": len(tokens), "hit_tokens": operation.storage_hit_count}
    if operation.storage_hit_count:
        operation.host_indices = controller.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)
        (transfer,) = [t for t in operation.pool_transfers if t.name == extra_name(args)]
        transfer.host_indices = extra.alloc(args.window * extra.page_size)
        controller.prefetch_buffer.put(operation)
        result["loaded_tokens"] = sglang_harness.wait_prefetch(controller)
        loaded = result["loaded_tokens"] // PAGE
        expected = seeded_pages(kv, args.pages, args.seed)[:loaded]
        result["kv_exact"] = all(torch.equal(kv.get_data_page(int(operation.host_indices[i * PAGE]), flat=True), page)
                                 for i, page in enumerate(expected))
        result["extra_exact"] = all(
            torch.equal(extra.get_data_page(int(transfer.host_indices[i * extra.page_size]), flat=True), page)
            for i, page in enumerate(seeded_pages(extra, args.window, args.seed + 100)))
    controller.detach_storage_backend()
    return result


DEFAULTS = {"target": None, "namespace": "", "kind": "swa", "seed": 1, "pages": 6, "window": 2, "no_state": False}


def main() -> None:
    results = []
    for step in json.loads(sys.argv[1]):
        args = argparse.Namespace(**{**DEFAULTS, **{k: v for k, v in step.items() if k != "op"}})
        started = time.monotonic()
        result = run_write(args) if step["op"] == "write" else run_read(args)
        results.append({**result, "seconds": round(time.monotonic() - started, 3)})
    print("HARNESS-RESULT " + json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
