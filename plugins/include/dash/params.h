/*
 * DASH attention: the one parameter struct every front end fills.
 *
 * The PyTorch binding (dash_trt/cuda.py, through ctypes), the TensorRT plugin and the tests
 * all fill a DashParams and call dash_run() (dash/dash.h). Kernels see nothing else. No
 * TensorRT or torch headers here: plain C, fixed-width fields, so the ctypes mirror in
 * dash_trt/cuda.py can be checked field by field (dash_params_offset()).
 *
 * Shapes: T new tokens in the batch, B sequences, H query heads, Hkv KV heads, D head dim,
 * Di indexer dim, NB KV blocks of `block_size` tokens, W block-table width,
 * sbs = sparse_block_size. All tensors are dense, row-major, on the device.
 * The function computed is dash_trt.paged.paged_dash_attention (docs/api.md).
 */
#ifndef DASH_PARAMS_H
#define DASH_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever DashParams changes layout (2: the tune_* fields; dash_plan / dash_run_plan; 8: the
 * routing fields of Unlimited-OCR-2's rule replace dense_layer and page_bias). */
#define DASH_ABI_VERSION 8

/* Blocks ranked by routing before the entmax prior (dash_trt.config.ROUTE_TOP_M). */
#define DASH_ROUTE_TOP_M 16

/* Routing rules a kernel library can implement (dash_routing_rule() in dash/dash.h). */
enum {
    DASH_ROUTING_WITHDRAWN = 1,      /* dash-trt's earlier rule: own-page blocks first, then by score, no prior */
    DASH_ROUTING_UNLIMITED_OCR2 = 2  /* the function (docs/spec.md step 4): own-page restriction, top 16,
                                        entmax-1.5 prior, keep topk, centred log-prior bias */
};

/* Data type of q/k/v/iq/ik/head_cls, the k/v/index caches and the output (one per call). */
typedef enum DashDtype { DASH_FLOAT32 = 0, DASH_FLOAT16 = 1, DASH_BFLOAT16 = 2 } DashDtype;

/* Columns of `coords` (same as dash_trt.paged.COORD_*). */
enum { DASH_COORD_TOK = 0, DASH_COORD_PAGE = 1, DASH_COORD_IMAGE_PAGE = 2, DASH_COORD_QUERY_PAGE = 3,
       DASH_NUM_COORDS = 4 };

/* Columns of `summary_pages` (same as dash_trt.paged.PAGE_*). */
enum { DASH_PAGE_LO = 0, DASH_PAGE_HI = 1, DASH_PAGE_DENSE = 2 };

typedef struct DashParams {
    /* ---- sizes (shape values, known on the host) ---- */
    int32_t num_tokens;    /* T: new tokens in this call, over all sequences */
    int32_t num_seqs;      /* B */
    int32_t num_heads;     /* H */
    int32_t num_kv_heads;  /* Hkv; H % Hkv == 0, query head h reads KV head h / (H / Hkv) */
    int32_t head_dim;      /* D: 64, 128 or 256 */
    int32_t index_dim;     /* Di: even, <= 512 */
    int32_t num_blocks;    /* NB: KV blocks in the cache */
    int32_t block_size;    /* tokens per KV block; a whole multiple of sparse_block_size */
    int32_t table_width;   /* W: columns of block_tables; W * block_size bounds every seq_len */
    int32_t max_new_tokens;/* upper bound on any one sequence's new tokens (<= T; 0: T); sizes grids. A
                              sequence with more is flagged (DASH_DATA_BAD_LENGTHS) and skipped. 1 (a
                              decode-only call, vLLM's max_query_len == 1) lets dash_run fold the write
                              and summary stages into the routing and attention launches. */
    int32_t dtype;         /* DashDtype */

    /* ---- configuration (the sparse_attention_config keys, this layer's values) ---- */
    int32_t sparse_block_size;  /* sbs: tokens per sparse block */
    int32_t sparse_local_block; /* sparse blocks in the local window (>= 1) */
    int32_t topk;               /* K: dash_topk_blocks, blocks kept of the top DASH_ROUTE_TOP_M (>= 1) */
    float route_scale;          /* this layer's routing scale: x = score * route_scale / sqrt(index_dim) */
    float prior_floor;          /* this layer's floor under the entmax prior before the log (> 0) */
    float sigma;                /* dash_sigma: divisor of the centred log prior (> 0) */
    int32_t rope_page_pairs;    /* sparse_rope_page_pairs */
    float rope_tok_theta;       /* sparse_rope_tok_theta */
    float rope_page_theta;      /* sparse_rope_page_theta */
    int32_t main_truncate;      /* sparse_main_rope_tok_freq_mode == "truncate" (q/k) */
    int32_t index_truncate;     /* sparse_rope_tok_freq_mode == "truncate" (iq/ik) */
    int32_t rope_page_mod;      /* sparse_rope_page_mod (0 = off) */

    /* ---- inputs ---- */
    const void* q;              /* [T, H, D] dtype, unrotated */
    const void* k;              /* [T, Hkv, D] dtype, unrotated */
    const void* v;              /* [T, Hkv, D] dtype */
    const void* iq;             /* [T, Di] dtype, unrotated */
    const void* ik;             /* [T, Di] dtype, unrotated */
    const int32_t* coords;      /* [T, 4]: tok, page, image_page, query_page */
    const void* head_cls;       /* [Di] dtype */
    const int32_t* block_tables;/* [B, W]: physical KV block of each logical block (-1 pad) */
    const int32_t* seq_lens;    /* [B]: tokens of each sequence after this call */
    const int32_t* query_start_loc; /* [B + 1]: rows of sequence b are [qsl[b], qsl[b+1]) */
    const int32_t* prompt_lens; /* [B]: prompt_length, -1 for none */

    /* ---- the paged cache (read and written in place) ---- */
    void* key_cache;            /* [NB, block_size, Hkv, D] dtype, keys after page RoPE */
    void* value_cache;          /* [NB, block_size, Hkv, D] dtype */
    void* index_key_cache;      /* [NB, block_size, Di] dtype, index keys after page RoPE */
    int32_t* image_page_cache;  /* [NB, block_size]: image page per token, -1 if none */
    float* summary_cache;       /* [NB, block_size / sbs, Di] float32: complete block summaries */
    int32_t* summary_pages_cache;/* [NB, block_size / sbs, 3]: lo, hi, dense flag */

    /* ---- output ---- */
    void* out;                  /* [T, H, D] dtype; its contents before the call are not read (a
                                   block-major prefill stages the rotated queries there first) */

    /* ---- scratch ---- */
    void* workspace;            /* dash_workspace_size(params) bytes, 256-byte aligned */
    size_t workspace_size;

    /* ---- optional debugging outputs (may be NULL) ---- */
    int32_t* selected_out;      /* [T, dash_max_selected(params)]: selected blocks, -1 padded */

    /* ---- tuning: 0 takes the documented default; tests and benchmarks pass others ---- */
    int32_t tune_block_major_min_tokens; /* prefill attention goes block-major from this many tokens
                                            (0: 1024; < 0: never) */
    int32_t tune_block_major_chunk;      /* tokens per block-major pass (0: 16384); the partials
                                            take tokens x slots x heads x (2 head_dim + 8) bytes */
    int32_t tune_attend_ctas;            /* split-K target (CTAs) of the token-major attention (0: 256) */
    int32_t tune_fused_front;            /* decode-only calls (max_new_tokens 1) fold the write and summary
                                            stages into the routing and attention launches (0: yes; < 0: no) */
    int32_t tune_front_writer;           /* where the folded write runs (0: its own CTA where the routing grid
                                            fits one wave, else the token's first routing CTA; 1: own CTA;
                                            2: the first routing CTA) */
    int32_t tune_tile_share_min;         /* block-major prefill: a tile of consecutive tokens of one sequence reads
                                            a sparse block itself (query-major, no partials) when at least this
                                            many of its tokens select it, anywhere before it; its local windows
                                            always (0: 5/8 of the tile's tokens; < 0: no query-major tiles) */
    int32_t tune_warpgroup_mma;          /* block-major prefill on an sm_90 GPU, with a build for architecture 90a,
                                            head dim 128: the tiles as warpgroup MMAs (0: the block-major and the
                                            query-major tiles; 1: the block-major ones only; 2: the query-major
                                            ones only; < 0: the mma.sync tiles of sm_80 / sm_89 everywhere) */
    int32_t tune_block_major_warpgroups; /* where the block-major tiles are warpgroup MMAs: warpgroups per CTA,
                                            sharing one block's keys and values (0: the plan picks by the
                                            rows a block can expect per pass; 1; 2; any other value is
                                            DASH_ERR_INVALID_ARGUMENT) */
    int32_t tune_block_major_ctas;       /* block-major tiles: CTAs per KV head (0: one a work item; > 0:
                                            that many, at most one a work item, each serving work items
                                            in turn; < 0: DASH_ERR_INVALID_ARGUMENT) */
    int32_t tune_tile_overlap;           /* block-major prefill on sm_90 and later GPUs: the query-major tiles
                                            start while the block-major tiles finish (programmatic dependent
                                            launch) and wait for them only before merging their partials
                                            (0: yes; < 0: no; ignored before sm_90) */
} DashParams;

#ifdef __cplusplus
}
#endif

#endif /* DASH_PARAMS_H */
