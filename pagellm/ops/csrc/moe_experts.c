/* A mixture-of-experts layer's experts on the CPU in one call: every (token, expert) pair of the step, grouped by
 * expert, through gate/up, SiLU-and-multiply, down, the router weight, and the sum back into the token's row.
 *
 * Why not one torch.mm per expert: in a decode step an expert gets one to a few rows, and a GEMM with so few rows
 * is bound by reading the expert's weights once; torch's GEMM on the transposed stacked slice spent most of a
 * step re-laying out those weights (2 rows cost 1.7x 1 row), and each of the ~2 x experts-used calls per layer
 * pays a dispatch. Here the step's work (experts x blocks of PANEL features) is one parallel loop over all threads.
 *
 * The weights are packed once at load (moe_pack_experts) into panels of PANEL features: for each input element k
 * the PANEL weights of consecutive features are adjacent, so a register tile of up to TILE_ROWS rows x PANEL
 * features takes one broadcast of x per row and PANEL / VEC weight vectors per k, and the panel is read front to
 * back once per tile (from L2 while an expert's rows run through it, from memory once in a decode step). The
 * earlier layout (a weight row dotted with rows of x) loaded as many x vectors as weight vectors per
 * multiply-add and needed a horizontal sum per output.
 *
 * Layouts (contiguous; x, the weights and out share one dtype, float32 or bfloat16):
 *   x        [tokens, hidden]
 *   w13      [experts, 2 * inter, hidden]: gate rows, then up rows (as loaded; moe_pack_experts reads it)
 *   w2       [experts, hidden, inter]
 *   w13p     [experts, panels(inter), 2, hidden, PANEL]: [e, b, 0, k, j] = w13[e, b * PANEL + j, k] (gate) and
 *            [e, b, 1, k, j] = w13[e, inter + b * PANEL + j, k] (up); features past inter are zeros
 *   w2p      [experts, panels(hidden), inter, PANEL]: [e, b, k, j] = w2[e, b * PANEL + j, k]; zeros past hidden
 *   ids      [tokens, top_k] int64, each in [0, experts)
 *   weights  [tokens, top_k] float32, the router's weight of each choice
 *   out      [tokens, hidden]
 *
 * On CPUs with avx512_bf16 (HAVE_BF16_DOT) bfloat16 experts take VDPBF16PS instead, on linear_bf16's layout of each
 * expert's two matrices (moe_experts' layout 2; hidden and inter multiples of 16):
 *   w13d     [experts, 2 * inter / 16, hidden / 2, 16, 2]: [e, p, k, j, i] = w13[e, 16 p + j, 2 k + i], so gate's
 *            panel b is p = b and up's is p = inter / 16 + b
 *   w2d      [experts, hidden / 16, inter / 2, 16, 2]: [e, p, k, j, i] = w2[e, 16 p + j, 2 k + i]
 * Each sum runs in linear_bf16's order (one float32 accumulator per output, input pairs in order), so a product
 * is the per-expert linear_bf16 call's to the bit, and on CPUs with AMX a prefill step can run its busy experts
 * through linear_bf16's tiles on the same packed weights (pagellm/layers/fused_moe.py chooses per step). The
 * earlier path, one linear_bf16 call per used expert and product from Python, paid a Python call and an OpenMP
 * team per product: ~150 of them in a 16-token decode step of a layer of 128 experts with top-8 routing.
 *
 * Numerics follow the grouped torch path: float32 accumulation; in bfloat16 every value torch would store (the
 * gate/up product, silu(gate), the activation, the down product, its weighted row) is rounded to bfloat16 at the
 * same point. A token's rows are summed in float32 in ascending expert order from zero and rounded once, as
 * torch's index_add_ over bfloat16 rows sorted by expert sums them (it accumulates in float32).
 */
#include <stdlib.h>

#include "vec.h"

#define PANEL 16 /* features (gate/up) or outputs (down) per panel and per work item */
#define PANEL_VECS (PANEL / VEC)
#define TILE_ROWS 6 /* rows per register tile: 6 x PANEL_VECS accumulators (12 on AVX2) */
#define PARALLEL_MIN_MACS 65536

typedef struct {
    int64_t expert, begin, end; /* rows [begin, end) of the sorted pairs */
    int64_t panel;              /* features or outputs [panel * PANEL, panel * PANEL + PANEL) */
} WorkItem;

static ALWAYS_INLINE int64_t panels_of(int64_t width) { return (width + PANEL - 1) / PANEL; }

static ALWAYS_INLINE fvec stored_vec(fvec v, const int bf16) { return bf16 ? round_bf16(v) : v; }

/* out[r] = x[r] . panel over `length` elements, PANEL outputs per row, for `rows` rows (a constant after
 * inlining). The sums stay in a local tile until the end: the caller's array, indexed by a variable later, would
 * keep them in memory. */
static ALWAYS_INLINE void panel_tile(const void *const *x, const void *panel, int64_t length,
                                     fvec out[TILE_ROWS][PANEL_VECS], const int rows, const int bf16) {
    fvec acc[TILE_ROWS][PANEL_VECS];
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] = splat(0.0f);
    const void *row[TILE_ROWS];
    for (int r = 0; r < rows; ++r) row[r] = x[r];
    for (int64_t k = 0; k < length; ++k) {
        fvec w[PANEL_VECS];
        for (int v = 0; v < PANEL_VECS; ++v) w[v] = load_any(panel, k * PANEL + v * VEC, bf16);
        for (int r = 0; r < rows; ++r) {
            const fvec a = splat(scalar_any(row[r], k, bf16));
            for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] += a * w[v];
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < PANEL_VECS; ++v) out[r][v] = acc[r][v];
}

/* One function per (rows, dtype), not inlined into the work items: inlined, the caller's live values pushed an
 * accumulator of the 6-row tile out to the stack in one of them, which halved its speed. */
#define TILE_FUNCTION(R, B)                                                                                     \
    static __attribute__((noinline)) void tile_##R##_##B(const void *const *x, const void *panel, int64_t length, \
                                                         fvec out[TILE_ROWS][PANEL_VECS]) {                     \
        panel_tile(x, panel, length, out, R, B);                                                                \
    }
#define TILE_FUNCTIONS(B) TILE_FUNCTION(1, B) TILE_FUNCTION(2, B) TILE_FUNCTION(3, B) TILE_FUNCTION(4, B) \
    TILE_FUNCTION(5, B) TILE_FUNCTION(6, B)
TILE_FUNCTIONS(0)
TILE_FUNCTIONS(1)

static ALWAYS_INLINE void panel_rows(const void *const *x, const void *panel, int64_t length,
                                     fvec acc[TILE_ROWS][PANEL_VECS], int rows, const int bf16) {
#define CALL(B)                                                   \
    switch (rows) {                                               \
    case 6: tile_6_##B(x, panel, length, acc); break;             \
    case 5: tile_5_##B(x, panel, length, acc); break;             \
    case 4: tile_4_##B(x, panel, length, acc); break;             \
    case 3: tile_3_##B(x, panel, length, acc); break;             \
    case 2: tile_2_##B(x, panel, length, acc); break;             \
    default: tile_1_##B(x, panel, length, acc); break;            \
    }
    if (bf16) {
        CALL(1)
    } else {
        CALL(0)
    }
#undef CALL
}

/* silu(gate) * up as torch computes it, g * sigmoid(g), the sigmoid from e^-|g| so nothing overflows; each
 * product stored as torch stores it. */
static ALWAYS_INLINE fvec silu_times(fvec gate, fvec up, const int bf16) {
    const fvec magnitude = vselect(gate < 0.0f, -gate, gate);
    const fvec e = exp_nonpositive(-magnitude);
    const fvec sigmoid = vselect(gate < 0.0f, e, splat(1.0f)) / (1.0f + e);
    return stored_vec(stored_vec(gate * sigmoid, bf16) * up, bf16);
}

typedef struct {
    const void *x, *w13p, *w2p;
    const int64_t *row_token;  /* [pairs] token of each sorted row */
    const float *row_weight;   /* [pairs] router weight of each sorted row */
    const int64_t *token_rows; /* [tokens, top_k] sorted rows of each token, ascending */
    void *activated;           /* [pairs, panels(inter) * PANEL], x's dtype */
    float *rows_out;           /* [pairs, panels(hidden) * PANEL], values as x's dtype stores them */
    void *out;
    int64_t hidden, inter, top_k;
} Layer;

/* activated[r, features of the item's panel] for the item's rows: the gate panel's tile, then the up panel's. */
static ALWAYS_INLINE void gate_up_item(const Layer *l, const WorkItem *item, const int bf16) {
    const int64_t size = bf16 ? 2 : 4, hidden = l->hidden, stride = panels_of(l->inter) * PANEL;
    const char *gate = (const char *)l->w13p + ((item->expert * panels_of(l->inter) + item->panel) * 2) * hidden
                                                   * PANEL * size;
    const char *up = gate + hidden * PANEL * size;
    for (int64_t r = item->begin; r < item->end; r += TILE_ROWS) {
        const int rows = item->end - r < TILE_ROWS ? (int)(item->end - r) : TILE_ROWS;
        const void *x[TILE_ROWS];
        for (int i = 0; i < rows; ++i) x[i] = (const char *)l->x + l->row_token[r + i] * hidden * size;
        fvec gates[TILE_ROWS][PANEL_VECS], ups[TILE_ROWS][PANEL_VECS];
        panel_rows(x, gate, hidden, gates, rows, bf16);
        panel_rows(x, up, hidden, ups, rows, bf16);
        for (int i = 0; i < rows; ++i)
            for (int v = 0; v < PANEL_VECS; ++v)
                store_any(l->activated, (r + i) * stride + item->panel * PANEL + v * VEC,
                          silu_times(stored_vec(gates[i][v], bf16), stored_vec(ups[i][v], bf16), bf16), bf16);
    }
}

/* rows_out[r, outputs of the item's panel] = (activated[r] . w2 rows) * router weight, for the item's rows. */
static ALWAYS_INLINE void down_item(const Layer *l, const WorkItem *item, const int bf16) {
    const int64_t size = bf16 ? 2 : 4, inter = l->inter, stride = panels_of(l->hidden) * PANEL;
    const int64_t activated_stride = panels_of(inter) * PANEL;
    const char *panel = (const char *)l->w2p + (item->expert * panels_of(l->hidden) + item->panel) * inter * PANEL
                                                   * size;
    for (int64_t r = item->begin; r < item->end; r += TILE_ROWS) {
        const int rows = item->end - r < TILE_ROWS ? (int)(item->end - r) : TILE_ROWS;
        const void *x[TILE_ROWS];
        for (int i = 0; i < rows; ++i) x[i] = (const char *)l->activated + (r + i) * activated_stride * size;
        fvec acc[TILE_ROWS][PANEL_VECS];
        panel_rows(x, panel, inter, acc, rows, bf16);
        for (int i = 0; i < rows; ++i) {
            const fvec router_weight = splat(bf16 ? round_bf16(splat(l->row_weight[r + i]))[0] : l->row_weight[r + i]);
            for (int v = 0; v < PANEL_VECS; ++v)
                vstore(l->rows_out + (r + i) * stride + item->panel * PANEL + v * VEC,
                       stored_vec(stored_vec(acc[i][v], bf16) * router_weight, bf16));
        }
    }
}

static ALWAYS_INLINE void store_scalar(void *p, int64_t index, float v, const int bf16) {
    if (!bf16) {
        ((float *)p)[index] = v;
        return;
    }
    const hvec bits = to_bf16_bits(splat(v));
    ((uint16_t *)p)[index] = bits[0];
}

static ALWAYS_INLINE void sum_token(const Layer *l, int64_t token, const int bf16) {
    const int64_t *rows = l->token_rows + token * l->top_k, stride = panels_of(l->hidden) * PANEL;
    for (int64_t h = 0; h < l->hidden; ++h) {
        float sum = 0.0f;
        for (int64_t j = 0; j < l->top_k; ++j) sum += l->rows_out[rows[j] * stride + h];
        store_scalar(l->out, token * l->hidden + h, sum, bf16);
    }
}

/* `per_expert` items (panels of features or outputs) for every expert with rows. */
static int64_t make_items(WorkItem *items, const int64_t *start, int64_t experts, int64_t per_expert) {
    int64_t count = 0;
    for (int64_t e = 0; e < experts; ++e) {
        if (start[e] == start[e + 1]) continue;
        for (int64_t panel = 0; panel < per_expert; ++panel)
            items[count++] = (WorkItem){e, start[e], start[e + 1], panel};
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


#ifdef HAVE_BF16_DOT
const int pagellm_moe_bf16_dot_available = 1;

#define DOT_ROWS 8   /* rows per register tile: 8 x DOT_PANELS accumulators of 32 */
#define DOT_PANELS 2 /* gate's and up's panel, or two panels of down's outputs */

/* out[r][p] = x[r] . panel p over `pairs` input pairs (16 outputs per panel): per pair, one weight vector per panel
 * and one broadcast of x's pair per row, as linear_bf16's tile. */
static ALWAYS_INLINE void dot_tile(const uint16_t *const *x, const uint16_t *const *panel, int64_t pairs,
                                   __m512 out[DOT_ROWS][DOT_PANELS], const int rows, const int panels) {
    __m512 acc[DOT_ROWS][DOT_PANELS];
    for (int r = 0; r < rows; ++r)
        for (int p = 0; p < panels; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; ++k) {
        __m512bh w[DOT_PANELS];
        for (int p = 0; p < panels; ++p) w[p] = (__m512bh)_mm512_loadu_si512(panel[p] + k * 32);
        for (int r = 0; r < rows; ++r) {
            uint32_t pair;
            memcpy(&pair, x[r] + 2 * k, sizeof pair);
            const __m512bh broadcast = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int p = 0; p < panels; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], broadcast, w[p]);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int p = 0; p < panels; ++p) out[r][p] = acc[r][p];
}

/* One function per (rows, panels), not inlined, for the reason the float tiles above give. */
#define DOT_FUNCTION(R, P)                                                                                       \
    static __attribute__((noinline)) void dot_##R##_##P(const uint16_t *const *x, const uint16_t *const *panel, \
                                                        int64_t pairs, __m512 out[DOT_ROWS][DOT_PANELS]) {      \
        dot_tile(x, panel, pairs, out, R, P);                                                                    \
    }
#define DOT_FUNCTIONS(R) DOT_FUNCTION(R, 1) DOT_FUNCTION(R, 2)
DOT_FUNCTIONS(1) DOT_FUNCTIONS(2) DOT_FUNCTIONS(3) DOT_FUNCTIONS(4) DOT_FUNCTIONS(5) DOT_FUNCTIONS(6)
DOT_FUNCTIONS(7) DOT_FUNCTIONS(8)

static void dot_rows(const uint16_t *const *x, const uint16_t *const *panel, int64_t pairs,
                     __m512 out[DOT_ROWS][DOT_PANELS], int rows, int panels) {
#define CASE(R)                                                   \
    case R:                                                       \
        if (panels == 2) dot_##R##_2(x, panel, pairs, out);       \
        else dot_##R##_1(x, panel, pairs, out);                   \
        break;
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) default : CASE(8)
    }
#undef CASE
}

/* activated[r, the item's 16 features] for the item's rows, from gate's and up's panels in one tile. */
static void gate_up_item_dot(const Layer *l, const WorkItem *item) {
    const int64_t hidden = l->hidden, inter = l->inter, pairs = hidden / 2, inter_panels = inter / PANEL;
    const uint16_t *expert = (const uint16_t *)l->w13p + item->expert * 2 * inter_panels * pairs * 32;
    const uint16_t *panel[DOT_PANELS] = {expert + item->panel * pairs * 32,
                                         expert + (inter_panels + item->panel) * pairs * 32};
    for (int64_t r = item->begin; r < item->end; r += DOT_ROWS) {
        const int rows = item->end - r < DOT_ROWS ? (int)(item->end - r) : DOT_ROWS;
        const uint16_t *x[DOT_ROWS];
        for (int i = 0; i < rows; ++i) x[i] = (const uint16_t *)l->x + l->row_token[r + i] * hidden;
        __m512 acc[DOT_ROWS][DOT_PANELS];
        dot_rows(x, panel, pairs, acc, rows, 2);
        for (int i = 0; i < rows; ++i)
            store_any(l->activated, (r + i) * inter + item->panel * PANEL,
                      silu_times(round_bf16((fvec)acc[i][0]), round_bf16((fvec)acc[i][1]), 1), 1);
    }
}

/* rows_out[r, the item's one or two panels of 16 outputs] = (activated[r] . w2 rows) * router weight. */
static void down_item_dot(const Layer *l, const WorkItem *item) {
    const int64_t hidden = l->hidden, pairs = l->inter / 2, hidden_panels = hidden / PANEL;
    const int64_t first = item->panel * DOT_PANELS;
    const int panels = hidden_panels - first < DOT_PANELS ? (int)(hidden_panels - first) : DOT_PANELS;
    const uint16_t *expert = (const uint16_t *)l->w2p + item->expert * hidden_panels * pairs * 32;
    const uint16_t *panel[DOT_PANELS] = {expert + first * pairs * 32, expert + (first + 1) * pairs * 32};
    for (int64_t r = item->begin; r < item->end; r += DOT_ROWS) {
        const int rows = item->end - r < DOT_ROWS ? (int)(item->end - r) : DOT_ROWS;
        const uint16_t *x[DOT_ROWS];
        for (int i = 0; i < rows; ++i) x[i] = (const uint16_t *)l->activated + (r + i) * l->inter;
        __m512 acc[DOT_ROWS][DOT_PANELS];
        dot_rows(x, panel, pairs, acc, rows, panels);
        for (int i = 0; i < rows; ++i) {
            const fvec router_weight = splat(round_bf16(splat(l->row_weight[r + i]))[0]);
            for (int p = 0; p < panels; ++p)
                vstore(l->rows_out + (r + i) * hidden + (first + p) * PANEL,
                       round_bf16(round_bf16((fvec)acc[i][p]) * router_weight));
        }
    }
}

static void run_layer_dot(const Layer *l, const WorkItem *gate_up, int64_t gate_up_items, const WorkItem *down,
                          int64_t down_items, int64_t tokens, int parallel) {
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < gate_up_items; ++i) gate_up_item_dot(l, &gate_up[i]);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < down_items; ++i) down_item_dot(l, &down[i]);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) sum_token(l, t, 1);
    }
}
#else
const int pagellm_moe_bf16_dot_available = 0;
#endif

/* w13 and w2 (the stacked layouts above) into w13p and w2p, PANEL features at a time, zero-padded. Copies
 * elements of `size` bytes as they are. */
void moe_pack_experts(const void *w13, const void *w2, void *w13p, void *w2p, int64_t experts, int64_t hidden,
                     int64_t inter, int bf16) {
    const int64_t size = bf16 ? 2 : 4, inter_panels = panels_of(inter), hidden_panels = panels_of(hidden);
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < experts; ++e) {
        const char *gate_up = (const char *)w13 + e * 2 * inter * hidden * size;
        char *packed = (char *)w13p + e * inter_panels * 2 * hidden * PANEL * size;
        memset(packed, 0, (size_t)(inter_panels * 2 * hidden * PANEL * size));
        for (int64_t f = 0; f < 2 * inter; ++f) {
            const int64_t which = f >= inter, feature = f - which * inter;
            char *panel = packed + ((feature / PANEL) * 2 + which) * hidden * PANEL * size;
            for (int64_t k = 0; k < hidden; ++k)
                memcpy(panel + (k * PANEL + feature % PANEL) * size, gate_up + (f * hidden + k) * size, (size_t)size);
        }
        const char *down = (const char *)w2 + e * hidden * inter * size;
        packed = (char *)w2p + e * hidden_panels * inter * PANEL * size;
        memset(packed, 0, (size_t)(hidden_panels * inter * PANEL * size));
        for (int64_t h = 0; h < hidden; ++h) {
            char *panel = packed + (h / PANEL) * inter * PANEL * size;
            for (int64_t k = 0; k < inter; ++k)
                memcpy(panel + (k * PANEL + h % PANEL) * size, down + (h * inter + k) * size, (size_t)size);
        }
    }
}

/* layout: 0 float32 panels, 1 bfloat16 panels (w13p, w2p), 2 bfloat16 in linear_bf16's layout (w13d, w2d; builds
 * with HAVE_BF16_DOT only, hidden and inter multiples of 16).
 * activated: [tokens * top_k, panels(inter) * PANEL] of x's dtype, rows_out: [tokens * top_k, panels(hidden) * PANEL]
 * float32, the caller's scratch (kept between calls: fresh memory of that size each step would be faulted in
 * page by page, ~90 MB per layer for a 2,048-token prefill of Qwen3-30B-A3B's shape).
 * Returns 0, 1 for an expert id out of range, 2 for sizes the kernel does not take, 3 when out of memory. */
int moe_experts(const void *x, const void *w13p, const void *w2p, const int64_t *ids, const float *weights, void *out,
                int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t inter, int layout,
                void *activated, float *rows_out) {
    if (inter < 1 || hidden < 1 || tokens < 0 || top_k < 1 || experts < 1 || layout < 0 || layout > 2) return 2;
    if (layout == 2 && (!pagellm_moe_bf16_dot_available || hidden % PANEL != 0 || inter % PANEL != 0)) return 2;
    const int64_t pairs = tokens * top_k;
    for (int64_t i = 0; i < pairs; ++i)
        if (ids[i] < 0 || ids[i] >= experts) return 1;
    const int64_t blocks = panels_of(inter > hidden ? inter : hidden);
    int64_t *start = calloc((size_t)(2 * experts + 1), sizeof *start); /* and each expert's next free row */
    int64_t *ints = malloc((size_t)(2 * pairs + 1) * sizeof *ints);
    float *row_weight = malloc((size_t)pairs * sizeof *row_weight);
    WorkItem *items = malloc((size_t)(2 * experts * blocks) * sizeof *items);
    int status = 0;
    if (!start || !ints || !row_weight || !items) {
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
    const Layer layer = {x, w13p, w2p, row_token, row_weight, token_rows, activated, rows_out, out, hidden, inter,
                         top_k};
    const int parallel = pairs * hidden * inter >= PARALLEL_MIN_MACS;
    const int64_t gate_up_items = make_items(gate_up, start, experts, panels_of(inter));
#ifdef HAVE_BF16_DOT
    if (layout == 2) {
        const int64_t down_items = make_items(down, start, experts, (panels_of(hidden) + DOT_PANELS - 1) / DOT_PANELS);
        run_layer_dot(&layer, gate_up, gate_up_items, down, down_items, tokens, parallel);
        goto done;
    }
#endif
    const int64_t down_items = make_items(down, start, experts, panels_of(hidden));
    if (layout == 1) run_layer(&layer, gate_up, gate_up_items, down, down_items, tokens, parallel, 1);
    else run_layer(&layer, gate_up, gate_up_items, down, down_items, tokens, parallel, 0);
done:
    free(start);
    free(ints);
    free(row_weight);
    free(items);
    return status;
}
