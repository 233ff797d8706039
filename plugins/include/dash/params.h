/*
 * DASH attention: the one parameter struct every front end fills.
 *
 * The PyTorch binding (dash_trt/cuda.py, through ctypes), the TensorRT plugin and the tests
 * all fill a DashParams and call dash_run() (dash/dash.h). Kernels see nothing else. No
 * TensorRT or torch headers here: plain C, fixed-width fields. The fields are one table,
 * dash/params.def: the struct below, and the layout the library reports (dash_params_field), from
 * which the ctypes mirror in dash_trt/cuda.py is built.
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
 * routing fields of Unlimited-OCR-2's rule replace dense_layer and page_bias; 9: bias_out, the kernels route by Unlimited-OCR-2's rule). */
#define DASH_ABI_VERSION 9

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

/* Groups of DashParams fields (dash/params.def). */
typedef enum DashParamGroup {
    DASH_GROUP_SIZE = 0,
    DASH_GROUP_CONFIG = 1,
    DASH_GROUP_INPUT = 2,
    DASH_GROUP_CACHE = 3,
    DASH_GROUP_OUTPUT = 4,
    DASH_GROUP_SCRATCH = 5,
    DASH_GROUP_DEBUG = 6,
    DASH_GROUP_TUNE = 7
} DashParamGroup;

/* Every field, its type, shape and meaning: dash/params.def. */
typedef struct DashParams {
#define DASH_PARAM(type, name, group, doc) type name;
#include "dash/params.def"
#undef DASH_PARAM
} DashParams;

#ifdef __cplusplus
}
#endif

#endif /* DASH_PARAMS_H */
