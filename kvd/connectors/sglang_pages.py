"""SGLang's host KV pools seen as pages in kvd's block layout: strided views, no copies.

Every host layout an MHA pool offers (layer_first, page_first,
page_first_direct, page_head) is viewed as [pages, layers, 2, page_size,
heads, head_dim], an MLA pool's latent as [pages, layers, 1, page_size, 1,
width]: one indexed copy moves any set of pages into or out of kvd's rows.
"""

from __future__ import annotations

from typing import Any

import torch

# Host layouts this backend can view as [pages, layers, 2, page_size, heads, head_dim].
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
LATENT_LAYOUTS = ("layer_first", "page_first", "page_first_direct")  # what an MLA host pool offers


def is_latent(host_pool: Any) -> bool:
    """An MLA host pool: one latent per token and layer (kv_cache_dim wide), no K and V."""
    return hasattr(host_pool, "kv_lora_rank") and hasattr(host_pool, "kv_cache_dim")


def page_view(host_pool: Any) -> torch.Tensor:
    """A strided view (no copy) of the host pool's whole buffer as
    [pages, layers, 2, page_size, heads, head_dim]: kvd's block layout
    ([pages, layers, 1, page_size, 1, width] for an MLA pool's latent)."""
    if is_latent(host_pool):
        return _latent_page_view(host_pool)
    buffer = host_pool.kv_buffer
    layers, heads, head_dim, page = host_pool.layer_num, host_pool.head_num, host_pool.head_dim, host_pool.page_size
    layout = host_pool.layout
    if layout == "layer_first":  # [2, L, tokens, H, D]
        return buffer.view(2, layers, -1, page, heads, head_dim).permute(2, 1, 0, 3, 4, 5)
    if layout == "page_first":  # [2, tokens, L, H, D]
        return buffer.view(2, -1, page, layers, heads, head_dim).permute(1, 3, 0, 2, 4, 5)
    if layout == "page_first_direct":  # [2, pages, L, P, H, D]
        return buffer.permute(1, 2, 0, 3, 4, 5)
    if layout == "page_head":  # [2, pages, H, P, L, D]
        return buffer.permute(1, 4, 0, 3, 2, 5)
    raise NotImplementedError(f"kvd: host layout {layout!r} is not supported (supported: {SUPPORTED_LAYOUTS})")


def _latent_page_view(host_pool: Any) -> torch.Tensor:
    buffer, layers, page, width = host_pool.kv_buffer, host_pool.layer_num, host_pool.page_size, host_pool.kv_cache_dim
    layout = host_pool.layout
    if layout == "layer_first":  # [L, tokens, 1, D]
        pages = buffer.view(layers, -1, page, 1, width).permute(1, 0, 2, 3, 4)
    elif layout == "page_first":  # [tokens, L, 1, D]
        pages = buffer.view(-1, page, layers, 1, width).permute(0, 2, 1, 3, 4)
    elif layout == "page_first_direct":  # [pages, L, P, 1, D]
        pages = buffer
    else:
        raise NotImplementedError(f"kvd: MLA host layout {layout!r} is not supported (supported: "
                                  f"{LATENT_LAYOUTS})")
    return pages.unsqueeze(2)


def flat_page_view(host_pool: Any, flat_page: torch.Tensor) -> torch.Tensor:
    """One page in SGLang's flat per-layout format (get_data_page(flat=True),
    set_from_flat_data_page) seen as [layers, 2, page_size, heads, head_dim]
    ([layers, 1, page_size, 1, width] for an MLA pool)."""
    if is_latent(host_pool):
        layers, page, width = host_pool.layer_num, host_pool.page_size, host_pool.kv_cache_dim
        if host_pool.layout == "page_first":  # [P, L, 1, D]
            return flat_page.view(page, layers, 1, width).permute(1, 0, 2, 3).unsqueeze(1)
        return flat_page.view(layers, page, 1, width).unsqueeze(1)  # [L, P, 1, D]
    layers, heads, head_dim, page = host_pool.layer_num, host_pool.head_num, host_pool.head_dim, host_pool.page_size
    layout = host_pool.layout
    if layout in ("layer_first", "page_first_direct"):  # [2, L, P, H, D]
        return flat_page.view(2, layers, page, heads, head_dim).permute(1, 0, 2, 3, 4)
    if layout == "page_first":  # [2, P, L, H, D]
        return flat_page.view(2, page, layers, heads, head_dim).permute(2, 0, 1, 3, 4)
    if layout == "page_head":  # [2, H, P, L, D]
        return flat_page.view(2, heads, page, layers, head_dim).permute(3, 0, 2, 1, 4)
    raise NotImplementedError(f"kvd: host layout {layout!r} is not supported (supported: {SUPPORTED_LAYOUTS})")


def page_ids(host_indices: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """Page numbers of `pages` whole pages of host token indices; raises
    unless every page is page_size consecutive tokens from a page boundary."""
    indices = host_indices.reshape(-1).to(device="cpu", dtype=torch.int64)
    if indices.numel() != pages * page_size:
        raise ValueError(f"kvd: {indices.numel()} host indices for {pages} pages of {page_size} tokens")
    rows = indices.view(pages, page_size)
    starts = rows[:, 0]
    offsets = torch.arange(page_size, dtype=torch.int64)
    if bool((starts % page_size).any()) or not torch.equal(rows - starts[:, None], offsets.expand(pages, -1)):
        raise ValueError("kvd: host indices are not whole pages starting on page boundaries")
    return starts // page_size
