/*
 * DASH attention: the C ABI over DashParams, shared by every front end.
 *
 * dash_run() enqueues the four stages (write with page RoPE, summarise completed sparse blocks,
 * route, attend) on `stream`. It never synchronises, never allocates and sizes its grids from
 * shape values only, so it can be captured in a CUDA graph. The caller provides
 * dash_workspace_size() bytes of device scratch.
 *
 * Errors: every function returns a DashStatus; dash_status_string() names it and
 * dash_last_error_message() gives the detail (thread-local), e.g. "unsupported head dim: 96".
 * Bad *data* (block-table entries outside the cache, lengths past the table) cannot be seen on
 * the host without a sync: kernels never read or write out of bounds because of it; they skip
 * the access and set a flag in the workspace that dash_read_data_errors() returns.
 */
#ifndef DASH_DASH_H
#define DASH_DASH_H

#include "dash/params.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DASH_API __declspec(dllexport)
#else
#define DASH_API __attribute__((visibility("default")))
#endif

/* Sparse blocks per sequence (table_width * block_size / sparse_block_size) up to which a prefill
 * may take the query-major tiles, whose workspace a wider table does not need: the workspace is
 * not monotone in table_width across this value, so a caller bounding it over a range of widths
 * (the TensorRT plugin) also evaluates the widest width at or below it. */
#define DASH_QUERY_MAJOR_MAX_BLOCKS 40960

typedef enum DashStatus {
    DASH_OK = 0,
    DASH_ERR_INVALID_ARGUMENT = 1, /* a size, pointer or configuration value is unusable */
    DASH_ERR_UNSUPPORTED = 2,      /* valid but not implemented (head dim, dtype, sizes) */
    DASH_ERR_WORKSPACE = 3,        /* workspace missing or smaller than dash_workspace_size() */
    DASH_ERR_CUDA = 4              /* a CUDA launch failed; the message holds cudaGetErrorString */
} DashStatus;

/* Data errors flagged by the kernels (bit mask, see dash_read_data_errors). */
enum {
    DASH_DATA_BAD_BLOCK_TABLE = 1, /* a needed block-table entry is outside [0, NB) */
    DASH_DATA_BAD_LENGTHS = 2      /* seq_lens / query_start_loc inconsistent or past the table */
};

DASH_API int32_t dash_abi_version(void);
DASH_API size_t dash_params_size(void);
/* Byte offset of a DashParams field by name, or -1 (lets bindings check their mirror). */
DASH_API int64_t dash_params_offset(const char* field);

/* Type codes of dash_params_field. */
enum { DASH_FIELD_INT32 = 0, DASH_FIELD_FLOAT32 = 1, DASH_FIELD_POINTER = 2, DASH_FIELD_UINT64 = 3 };

/* The DashParams layout, field by field in declaration order (dash/params.def): for 0 <= index < n
 * writes the field's name, type code, byte offset and group (DashParamGroup) where the pointers are
 * not NULL; returns n, the number of fields (any index). A binding builds its mirror from it.
 * Added with ABI 8. */
DASH_API int32_t dash_params_field(int32_t index, const char** name, int32_t* type, int64_t* offset,
                                   int32_t* group);

/* The GPU architectures the library was compiled for, as CMake's CUDA_ARCHITECTURES list with
 * commas: "80-real,89-real,90" is machine code for sm_80, sm_89 and sm_90 plus compute_90 PTX
 * (which newer GPUs JIT-compile). Added after ABI 3 was fixed: older libraries lack the symbol. */
DASH_API const char* dash_cuda_architectures(void);

/* The routing rule the kernels implement (DASH_ROUTING_*, dash/params.h). Added with ABI 8; from
 * ABI 9 on DASH_ROUTING_UNLIMITED_OCR2 (ABI 8 libraries reported DASH_ROUTING_WITHDRAWN and refused
 * every launch). */
DASH_API int32_t dash_routing_rule(void);

/* Head dims the attention kernels are compiled for; writes up to `cap`, returns the count. */
DASH_API int32_t dash_supported_head_dims(int32_t* dims, int32_t cap);

/* Width of selected_out and bias_out rows: the most blocks one token can select, min(topk, 16,
 * blocks a sequence can have). */
DASH_API int32_t dash_max_selected(const DashParams* p);

/* Checks sizes and configuration (no device access), and that every tensor pointer a call with
 * tokens needs is set. */
DASH_API DashStatus dash_validate(const DashParams* p);

/* Scratch bytes dash_run needs for these sizes (pointers are not looked at). */
DASH_API DashStatus dash_workspace_size(const DashParams* p, size_t* bytes);

/* Enqueue the operator on `stream` (a cudaStream_t): dash_plan, then dash_run_plan. */
DASH_API DashStatus dash_run(const DashParams* p, void* stream);

/* Plan once, run many times. dash_plan() validates the sizes, configuration and tuning of `p`
 * (its pointers are not read) and fills `plan`: grids, paths, shared memory and the workspace
 * layout. dash_run_plan() launches a plan for params with those same sizes, configuration and
 * tuning (checked, cheaply) and any pointers: a runtime plans once per step and layer shape and
 * runs each layer with its own tensors. The plan is plain data (copyable, no resources). */
typedef struct DashPlan {
    uint64_t opaque[96];
} DashPlan;
DASH_API DashStatus dash_plan(const DashParams* p, DashPlan* plan);
/* Workspace bytes of a plan (what dash_workspace_size gives for its params). */
DASH_API size_t dash_plan_workspace_size(const DashPlan* plan);
DASH_API DashStatus dash_run_plan(const DashParams* p, const DashPlan* plan, void* stream);
/* 1 if `plan` was filled by dash_plan for params with the sizes, configuration and tuning of `p`
 * (so dash_run_plan accepts it), else 0. A plan also depends on the device that was current
 * when it was made (its SM count and shared memory): keep plans per device. Added with ABI 8. */
DASH_API int32_t dash_plan_matches(const DashParams* p, const DashPlan* plan);

/* Copies the data-error mask of the last run using this workspace to *mask, synchronising
 * `stream`, then clears it. For tests and eager front ends; not for capture. */
DASH_API DashStatus dash_read_data_errors(const DashParams* p, void* stream, int32_t* mask);

DASH_API const char* dash_status_string(DashStatus status);
DASH_API const char* dash_last_error_message(void);

#ifdef __cplusplus
}
#endif

#endif /* DASH_DASH_H */
