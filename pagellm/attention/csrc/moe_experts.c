/* A mixture-of-experts layer's experts on the CPU in one call: every (token, expert) pair of the step, grouped by
 * expert, through gate/up, SiLU-and-multiply, down, the router weight, and the sum back into the token's row.
 *
 * Why not one torch.mm per expert: in a decode step an expert gets one to a few rows, and a GEMM with so few rows
 * is bound by reading the expert's weights once; torch's GEMM on the transposed stacked slice spent most of a
 * step re-laying out those weights (2 rows cost 1.7x 1 row), and each of the ~2 x experts-used calls per layer
 * pays a dispatch. Here each weight row is read once per span of rows and dotted with up to TILE_ROWS rows held
 * in registers, and the step's work (experts x feature blocks) is one parallel loop over both threads.
 *
 * Layouts (contiguous; x, the weights and out share one dtype, float32 or bfloat16):
 *   x        [tokens, hidden]
 *   w13      [experts, 2 * inter, hidden]: gate rows, then up rows
 *   w2       [experts, hidden, inter]
 *   ids      [tokens, top_k] int64, each in [0, experts)
 *   weights  [tokens, top_k] float32, the router's weight of each choice
 *   out      [tokens, hidden]
 *
 * Numerics follow the grouped torch path: float32 accumulation; in bfloat16 every value torch would store (the
 * gate/up product, silu(gate), the activation, the down product, its weighted row, each partial sum of a token's
 * rows) is rounded to bfloat16 at the same point. A token's rows are summed in ascending expert order from zero,
 * as index_add_ over rows sorted by expert sums them.
 */
#include <stdlib.h>

#include "vec.h"

#define TILE_ROWS 3      /* x rows per register tile: 3 x 4 accumulators, 3 x vectors and 1 weight vector */
#define TILE_WEIGHTS 4   /* weight rows per register tile: gate and up of 2 features, or 4 outputs of down */
#define BLOCK_FEATURES 16 /* intermediate features (phase 1) or hidden outputs (phase 2) per work item */
/* Rows per pass over an item's weights: the pass's x rows stay in L2 while every weight tile of the item is
 * dotted with them, instead of a long span's rows streaming from L3 once per tile. */
#define BLOCK_ROWS 24
#define PARALLEL_MIN_MACS 65536

typedef struct {
    int64_t expert, begin, end; /* rows [begin, end) of the sorted pairs */
    int64_t first, last;        /* features or outputs [first, last) */
} WorkItem;

static ALWAYS_INLINE float stored(float v, const int bf16) { return bf16 ? round_bf16(splat(v))[0] : v; }

static ALWAYS_INLINE void store_scalar(void *p, int64_t index, float v, const int bf16) {
    if (!bf16) {
        ((float *)p)[index] = v;
        return;
    }
    const hvec bits = to_bf16_bits(splat(v));
    ((uint16_t *)p)[index] = bits[0];
}

/* result[r][w] = dot(x[r], weight[w]) over `length` elements, for `rows` x rows and TILE_WEIGHTS weight rows;
 * `rows` is a constant after inlining. */
static ALWAYS_INLINE void dot_tile(const void *const *x, const void *const *weight, int64_t length,
                                   float result[TILE_ROWS][TILE_WEIGHTS], const int rows, const int bf16) {
    fvec acc[TILE_ROWS][TILE_WEIGHTS];
    for (int r = 0; r < rows; ++r)
        for (int w = 0; w < TILE_WEIGHTS; ++w) acc[r][w] = splat(0.0f);
    int64_t k = 0;
    for (; k + VEC <= length; k += VEC) {
        fvec xv[TILE_ROWS];
        for (int r = 0; r < rows; ++r) xv[r] = load_any(x[r], k, bf16);
        for (int w = 0; w < TILE_WEIGHTS; ++w) {
            const fvec wv = load_any(weight[w], k, bf16);
            for (int r = 0; r < rows; ++r) acc[r][w] += wv * xv[r];
        }
    }
    if (k < length) {
        const int64_t n = length - k;
        fvec xv[TILE_ROWS];
        for (int r = 0; r < rows; ++r) xv[r] = load_part(x[r], k, n, bf16);
        for (int w = 0; w < TILE_WEIGHTS; ++w) {
            const fvec wv = load_part(weight[w], k, n, bf16);
            for (int r = 0; r < rows; ++r) acc[r][w] += wv * xv[r];
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int w = 0; w < TILE_WEIGHTS; ++w) result[r][w] = vsum(acc[r][w]);
}

static ALWAYS_INLINE void dot_rows(const void *const *x, const void *const *weight, int64_t length,
                                   float result[TILE_ROWS][TILE_WEIGHTS], int rows, const int bf16) {
    switch (rows) {
    case 3: dot_tile(x, weight, length, result, 3, bf16); break;
    case 2: dot_tile(x, weight, length, result, 2, bf16); break;
    default: dot_tile(x, weight, length, result, 1, bf16); break;
    }
}

/* silu(gate) * up as torch computes it: g * sigmoid(g), the sigmoid from e^-|g| so nothing overflows. */
static ALWAYS_INLINE float silu_times(float gate, float up, const int bf16) {
    const float e = expf(-fabsf(gate));
    const float sigmoid = (gate < 0.0f ? e : 1.0f) / (1.0f + e);
    return stored(stored(gate * sigmoid, bf16) * up, bf16);
}

typedef struct {
    const void *x, *w13, *w2;
    const int64_t *row_token;  /* [pairs] token of each sorted row */
    const float *row_weight;   /* [pairs] router weight of each sorted row */
    const int64_t *token_rows; /* [tokens, top_k] sorted rows of each token, ascending */
    void *activated;           /* [pairs, inter], x's dtype */
    float *rows_out;           /* [pairs, hidden], values as x's dtype stores them */
    void *out;
    int64_t hidden, inter, top_k;
} Layer;

/* activated[r, f] for the item's rows and features: gate and up of two features per tile. */
static ALWAYS_INLINE void gate_up_item(const Layer *l, const WorkItem *item, const int bf16) {
    const int64_t size = bf16 ? 2 : 4, hidden = l->hidden, inter = l->inter;
    const char *expert_w = (const char *)l->w13 + item->expert * 2 * inter * hidden * size;
    for (int64_t block = item->begin; block < item->end; block += BLOCK_ROWS) {
      const int64_t block_end = block + BLOCK_ROWS < item->end ? block + BLOCK_ROWS : item->end;
      for (int64_t f = item->first; f < item->last; f += 2) {
        const void *weight[TILE_WEIGHTS] = {
            expert_w + f * hidden * size, expert_w + (f + 1) * hidden * size,
            expert_w + (inter + f) * hidden * size, expert_w + (inter + f + 1) * hidden * size};
        for (int64_t r = block; r < block_end; r += TILE_ROWS) {
            const int rows = block_end - r < TILE_ROWS ? (int)(block_end - r) : TILE_ROWS;
            const void *x[TILE_ROWS];
            for (int i = 0; i < rows; ++i) x[i] = (const char *)l->x + l->row_token[r + i] * hidden * size;
            float result[TILE_ROWS][TILE_WEIGHTS];
            dot_rows(x, weight, hidden, result, rows, bf16);
            for (int i = 0; i < rows; ++i)
                for (int j = 0; j < 2; ++j) {
                    const float gate = stored(result[i][j], bf16), up = stored(result[i][2 + j], bf16);
                    store_scalar(l->activated, (r + i) * inter + f + j, silu_times(gate, up, bf16), bf16);
                }
        }
      }
    }
}

/* rows_out[r, h] = (activated[r] . w2[h]) * router weight, for the item's rows and outputs. */
static ALWAYS_INLINE void down_item(const Layer *l, const WorkItem *item, const int bf16) {
    const int64_t size = bf16 ? 2 : 4, hidden = l->hidden, inter = l->inter;
    const char *expert_w = (const char *)l->w2 + item->expert * hidden * inter * size;
    for (int64_t block = item->begin; block < item->end; block += BLOCK_ROWS) {
      const int64_t block_end = block + BLOCK_ROWS < item->end ? block + BLOCK_ROWS : item->end;
      for (int64_t h = item->first; h < item->last; h += TILE_WEIGHTS) {
        const void *weight[TILE_WEIGHTS];
        for (int j = 0; j < TILE_WEIGHTS; ++j) weight[j] = expert_w + (h + j) * inter * size;
        for (int64_t r = block; r < block_end; r += TILE_ROWS) {
            const int rows = block_end - r < TILE_ROWS ? (int)(block_end - r) : TILE_ROWS;
            const void *x[TILE_ROWS];
            for (int i = 0; i < rows; ++i) x[i] = (const char *)l->activated + (r + i) * inter * size;
            float result[TILE_ROWS][TILE_WEIGHTS];
            dot_rows(x, weight, inter, result, rows, bf16);
            for (int i = 0; i < rows; ++i) {
                const float router_weight = stored(l->row_weight[r + i], bf16);
                for (int j = 0; j < TILE_WEIGHTS; ++j)
                    l->rows_out[(r + i) * hidden + h + j] = stored(stored(result[i][j], bf16) * router_weight, bf16);
            }
        }
      }
    }
}

static ALWAYS_INLINE void sum_token(const Layer *l, int64_t token, const int bf16) {
    const int64_t *rows = l->token_rows + token * l->top_k;
    for (int64_t h = 0; h < l->hidden; ++h) {
        float sum = 0.0f;
        for (int64_t j = 0; j < l->top_k; ++j) sum = stored(sum + l->rows_out[rows[j] * l->hidden + h], bf16);
        store_scalar(l->out, token * l->hidden + h, sum, bf16);
    }
}

/* Items of `width` features or outputs in blocks, for every expert with rows. */
static int64_t make_items(WorkItem *items, const int64_t *start, int64_t experts, int64_t width) {
    int64_t count = 0;
    for (int64_t e = 0; e < experts; ++e) {
        if (start[e] == start[e + 1]) continue;
        for (int64_t first = 0; first < width; first += BLOCK_FEATURES) {
            const int64_t last = first + BLOCK_FEATURES < width ? first + BLOCK_FEATURES : width;
            items[count++] = (WorkItem){e, start[e], start[e + 1], first, last};
        }
    }
    return count;
}

static ALWAYS_INLINE void run_layer(const Layer *l, const WorkItem *gate_up, int64_t gate_up_items,
                                    const WorkItem *down, int64_t down_items, int64_t tokens, int parallel,
                                    const int bf16) {
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < gate_up_items; ++i) gate_up_item(l, &gate_up[i], bf16);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < down_items; ++i) down_item(l, &down[i], bf16);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) sum_token(l, t, bf16);
    }
}

/* Returns 0, 1 for an expert id out of range, 2 for sizes the kernel does not take, 3 when out of memory. */
int moe_experts(const void *x, const void *w13, const void *w2, const int64_t *ids, const float *weights, void *out,
                int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t inter, int bf16) {
    if (inter % 2 || hidden % TILE_WEIGHTS || tokens < 0 || top_k < 1 || experts < 1) return 2;
    const int64_t pairs = tokens * top_k, size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < pairs; ++i)
        if (ids[i] < 0 || ids[i] >= experts) return 1;
    const int64_t blocks = (inter > hidden ? inter : hidden) / BLOCK_FEATURES + 1;
    int64_t *start = calloc((size_t)(2 * experts + 1), sizeof *start); /* and each expert's next free row */
    int64_t *ints = malloc((size_t)(2 * pairs + 1) * sizeof *ints);
    float *row_weight = malloc((size_t)pairs * sizeof *row_weight);
    float *rows_out = malloc((size_t)(pairs * hidden) * sizeof *rows_out);
    void *activated = malloc((size_t)(pairs * inter * size));
    WorkItem *items = malloc((size_t)(2 * experts * blocks) * sizeof *items);
    int status = 0;
    if (!start || !ints || !row_weight || !rows_out || !activated || !items) {
        status = 3;
        goto done;
    }
    /* A stable counting sort of the pairs by expert: an expert's rows keep token order. */
    int64_t *row_token = ints, *token_rows = ints + pairs, *filled = start + experts + 1;
    for (int64_t i = 0; i < pairs; ++i) ++start[ids[i] + 1];
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    memcpy(filled, start, (size_t)experts * sizeof *filled);
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t row = filled[ids[i]]++;
        row_token[row] = i / top_k;
        row_weight[row] = weights[i];
        token_rows[i] = row;
    }
    /* Each token's rows in ascending order (ascending expert), by insertion: top_k is small. */
    for (int64_t t = 0; t < tokens; ++t) {
        int64_t *rows = token_rows + t * top_k;
        for (int64_t j = 1; j < top_k; ++j)
            for (int64_t m = j; m > 0 && rows[m - 1] > rows[m]; --m) {
                const int64_t swap = rows[m];
                rows[m] = rows[m - 1];
                rows[m - 1] = swap;
            }
    }
    WorkItem *gate_up = items, *down = items + experts * blocks;
    const int64_t gate_up_items = make_items(gate_up, start, experts, inter);
    const int64_t down_items = make_items(down, start, experts, hidden);
    const Layer layer = {x, w13, w2, row_token, row_weight, token_rows, activated, rows_out, out, hidden, inter,
                         top_k};
    const int parallel = pairs * hidden * inter >= PARALLEL_MIN_MACS;
    if (bf16) run_layer(&layer, gate_up, gate_up_items, down, down_items, tokens, parallel, 1);
    else run_layer(&layer, gate_up, gate_up_items, down, down_items, tokens, parallel, 0);
done:
    free(start);
    free(ints);
    free(row_weight);
    free(rows_out);
    free(activated);
    free(items);
    return status;
}
