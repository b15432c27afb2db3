/* A Llama decode step's decoder layers in one call: per layer the same kernels, in the same order, with the same
 * arguments as models/llama.py's run_direct_layers makes them from Python (add_rms_norm, the qkv product,
 * rotary_inplace, the K/V write, paged_decode_attention, the o product, add_rms_norm, the gate_up product,
 * silu_and_mul, the down product), so its results are those of that path bit for bit. From Python each of those
 * calls costs microseconds of argument checks, tensor allocation and ctypes; a small model's decode step makes
 * ~300 of them, a large share of its time. The linear products are the GGUF kernels' gguf_matmul, reached
 * through a pointer (they live in their own library). */
#include "../../attention/csrc/kv_format.h"

#include <stdlib.h>
#include <string.h>

/* gguf_matmul's signature (pagellm/ops/csrc/gguf_quant.c). */
typedef int (*ProductFunction)(int type, const void *w, const void *x, int x_bf16, int64_t rows, int64_t in_features,
                               int64_t out_features, void *y, int y_bf16);

/* A linear layer of up to three GGUF parts (a fused qkv whose v has its own type), their outputs side by side. */
#define MAX_PARTS 3
typedef struct {
    const void *weights[MAX_PARTS];
    int64_t out_features[MAX_PARTS];
    int32_t types[MAX_PARTS];
    int32_t parts;
} StackLinear;

/* y [tokens, sum of the parts' outputs] = x [tokens, in_features] W^T, as the GGUF linear method's apply
 * computes it (each part's product, concatenated), in float32 or (bf16) bfloat16. With several parts and tokens,
 * each part's rows go through `scratch` (>= tokens * the widest part). Returns gguf_matmul's failure code, or 0. */
static int linear(ProductFunction product, const StackLinear *l, const void *x, int64_t tokens, int64_t in_features,
                  void *y, void *scratch, int bf16) {
    const int64_t element = bf16 ? 2 : 4;
    int64_t width = 0;
    for (int p = 0; p < l->parts; ++p) width += l->out_features[p];
    int64_t offset = 0;
    for (int p = 0; p < l->parts; ++p) {
        const int64_t out = l->out_features[p];
        const int direct = l->parts == 1 || tokens == 1;
        char *into = direct ? (char *)y + offset * element : (char *)scratch;
        const int failed = product(l->types[p], l->weights[p], x, bf16, tokens, in_features, out, into, bf16);
        if (failed) return failed;
        if (!direct)
            for (int64_t t = 0; t < tokens; ++t)
                memcpy((char *)y + (t * width + offset) * element, (char *)scratch + t * out * element, out * element);
        offset += out;
    }
    return 0;
}

/* One decoder layer's weights and its caches. */
typedef struct {
    StackLinear qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
    void *k_cache, *v_cache;
    int64_t sliding_window; /* 0: every key */
    float input_eps, post_eps, scale;
} StackLayer;

typedef struct {
    int64_t hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, block_size;
    int32_t kv_format; /* kv_format.h's code of the caches */
    int32_t bf16;      /* activations in bfloat16 (else float32) */
} StackShape;

/* The step: `tokens` decode tokens, one per sequence. */
typedef struct {
    const int64_t *positions;    /* [tokens] */
    const float *cos, *sin;      /* the rotary tables [max_positions, head_dim] */
    const int64_t *kv_rows;      /* [tokens * num_kv_heads]: attention/paged.py's kv_write_index */
    const int64_t *block_tables; /* [tokens, table_stride] */
    const int64_t *context_lens; /* [tokens] */
    int64_t tokens, table_stride;
} StackStep;

void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
                  float eps, int bf16);
void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16);
void rotary_inplace(void *qkv, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                    const float *cos_table, const float *sin_table, const int64_t *positions, int bf16);
void write_kv_rows(const void *k, const void *v, int64_t k_row_stride, int64_t v_row_stride, void *k_cache,
                   void *v_cache, const int64_t *rows, int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                   int64_t element_size);
void write_kv_rows_quantized(const void *k, const void *v, int64_t k_row_stride, int64_t v_row_stride, void *k_cache,
                             void *v_cache, const int64_t *rows, int64_t tokens, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int bf16, int format);
void write_kv_rows_to_bf16(const float *k, const float *v, int64_t k_row_stride, int64_t v_row_stride,
                           uint16_t *k_cache, uint16_t *v_cache, const int64_t *rows, int64_t tokens,
                           int64_t num_kv_heads, int64_t head_dim);
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, int kv_format, int q_is_bf16,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int64_t sliding_window,
                           const float *sinks, int use_amx);

/* Failures, as (code, layer): DECODE_STACK_PRODUCT + gguf_matmul's code, DECODE_STACK_ATTENTION + the
 * attention kernel's, or DECODE_STACK_MEMORY; the layer index is in *failed_layer. */
enum { DECODE_STACK_MEMORY = 1, DECODE_STACK_PRODUCT = 10, DECODE_STACK_ATTENTION = 20 };

/* Row buffers of one step, in the activations' dtype. */
typedef struct {
    char *x, *qkv, *q, *attended, *projected, *gate_up, *activated, *scratch;
} StackBuffers;

static char *carve(char **next, int64_t elements, int64_t element_size) {
    char *start = *next;
    *next += (elements * element_size + 63) / 64 * 64;
    return start;
}

static void *allocate_buffers(const StackShape *s, int64_t tokens, StackBuffers *b) {
    const int64_t element = s->bf16 ? 2 : 4, width = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
    const int64_t attention = s->num_heads * s->head_dim;
    const int64_t widest = 2 * s->intermediate_size > width ? 2 * s->intermediate_size : width;
    const int64_t per_token[8] = {s->hidden_size, width, attention, attention, s->hidden_size,
                                  2 * s->intermediate_size, s->intermediate_size, widest};
    int64_t bytes = 0;
    for (int i = 0; i < 8; ++i) bytes += (tokens * per_token[i] * element + 63) / 64 * 64;
    char *base = aligned_alloc(64, bytes > 0 ? bytes : 64), *next = base;
    if (base == NULL) return NULL;
    b->x = carve(&next, tokens * per_token[0], element);
    b->qkv = carve(&next, tokens * per_token[1], element);
    b->q = carve(&next, tokens * per_token[2], element);
    b->attended = carve(&next, tokens * per_token[3], element);
    b->projected = carve(&next, tokens * per_token[4], element);
    b->gate_up = carve(&next, tokens * per_token[5], element);
    b->activated = carve(&next, tokens * per_token[6], element);
    b->scratch = carve(&next, tokens * per_token[7], element);
    return base;
}

/* The step's K/V (rows of k_stride and v_stride elements, heads contiguous) into a layer's caches, as
 * native.KVWriter does. */
static void write_kv(const StackShape *s, const StackStep *step, const char *k, int64_t k_stride, const char *v,
                     int64_t v_stride, void *k_cache, void *v_cache) {
    if (kv_quantized(s->kv_format))
        write_kv_rows_quantized(k, v, k_stride, v_stride, k_cache, v_cache, step->kv_rows, step->tokens,
                                s->num_kv_heads, s->head_dim, s->block_size, s->bf16, s->kv_format);
    else if (s->kv_format == KV_BF16 && !s->bf16)  /* float32 activations over a bfloat16 cache */
        write_kv_rows_to_bf16((const float *)k, (const float *)v, k_stride, v_stride, k_cache, v_cache,
                              step->kv_rows, step->tokens, s->num_kv_heads, s->head_dim);
    else
        write_kv_rows(k, v, k_stride, v_stride, k_cache, v_cache, step->kv_rows, step->tokens, s->num_kv_heads,
                      s->head_dim, s->bf16 ? 2 : 4);
}

/* The queries as the attention kernel reads them, [tokens, num_heads, head_dim] contiguous: the rows they lead
 * (`width` elements apart) when there is one token, else copied out of them. */
static const char *queries(const StackShape *s, int64_t tokens, const char *rows, int64_t width, char *q) {
    if (tokens == 1) return rows;
    const int64_t element = s->bf16 ? 2 : 4, bytes = s->num_heads * s->head_dim * element;
    for (int64_t t = 0; t < tokens; ++t) memcpy(q + t * bytes, rows + t * width * element, bytes);
    return q;
}

/* Layers [0, num_layers) over `embedded` [tokens, hidden_size]: `hidden` gets the last layer's output and
 * `residual` the residual stream beside it (run_direct_layers' (hidden, residual)), both [tokens, hidden_size].
 * Returns 0, or a failure code with *failed_layer set. */
int decode_layer_stack(const StackLayer *layers, int64_t num_layers, const StackShape *s, const StackStep *step,
                       ProductFunction product, const void *embedded, void *hidden, void *residual,
                       int64_t *failed_layer) {
    const int64_t tokens = step->tokens, element = s->bf16 ? 2 : 4, hidden_size = s->hidden_size;
    const int64_t width = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim, attention = s->num_heads * s->head_dim;
    const int bf16 = s->bf16;
    *failed_layer = -1;
    if (tokens <= 0 || num_layers <= 0) return 0;
    StackBuffers b;
    void *base = allocate_buffers(s, tokens, &b);
    if (base == NULL) return DECODE_STACK_MEMORY;
    int failed = 0;
    /* The first layer's residual is its input itself (run_direct_layers: residual = hidden). */
    memcpy(residual, embedded, tokens * hidden_size * element);
    for (int64_t l = 0; l < num_layers && !failed; ++l) {
        const StackLayer *layer = layers + l;
        *failed_layer = l;
        if (l == 0) add_rms_norm(residual, NULL, layer->input_norm, b.x, tokens, hidden_size, layer->input_eps, bf16);
        else add_rms_norm(hidden, residual, layer->input_norm, b.x, tokens, hidden_size, layer->input_eps, bf16);
        if ((failed = linear(product, &layer->qkv, b.x, tokens, hidden_size, b.qkv, b.scratch, bf16)))
            failed += DECODE_STACK_PRODUCT;
        if (failed) break;
        rotary_inplace(b.qkv, tokens, width, s->num_heads + s->num_kv_heads, s->head_dim, step->cos, step->sin,
                       step->positions, bf16);
        const int64_t k_offset = attention * element, v_offset = k_offset + s->num_kv_heads * s->head_dim * element;
        write_kv(s, step, b.qkv + k_offset, width, b.qkv + v_offset, width, layer->k_cache, layer->v_cache);
        const char *q = queries(s, tokens, b.qkv, width, b.q);
        if ((failed = paged_decode_attention(q, layer->k_cache, layer->v_cache, s->kv_format, bf16,
                                             step->block_tables, step->table_stride, step->context_lens, b.attended,
                                             tokens, s->num_heads, s->num_kv_heads, s->head_dim, s->block_size,
                                             layer->scale, layer->sliding_window, NULL, 1)))
            failed += DECODE_STACK_ATTENTION;
        if (failed) break;
        if ((failed = linear(product, &layer->o, b.attended, tokens, attention, b.projected, b.scratch, bf16)))
            failed += DECODE_STACK_PRODUCT;
        if (failed) break;
        add_rms_norm(b.projected, residual, layer->post_norm, b.x, tokens, hidden_size, layer->post_eps, bf16);
        if ((failed = linear(product, &layer->gate_up, b.x, tokens, hidden_size, b.gate_up, b.scratch, bf16)))
            failed += DECODE_STACK_PRODUCT;
        if (failed) break;
        silu_and_mul(b.gate_up, b.activated, tokens, s->intermediate_size, bf16);
        if ((failed = linear(product, &layer->down, b.activated, tokens, s->intermediate_size, hidden, b.scratch,
                             bf16)))
            failed += DECODE_STACK_PRODUCT;
    }
    if (!failed) *failed_layer = -1;
    free(base);
    return failed;
}

/* ---- Gemma 3 -------------------------------------------------------------------------------------------- */

void gemma_rms_norm(const void *x, void *residual, const float *weight, void *out, int64_t rows, int64_t hidden,
                    float eps, int bf16);
void add_into(void *into, const void *x, int64_t n, int bf16);

/* One Gemma 3 decoder layer: its linear layers, its norms' weights as gemma_rms_norm takes them (1 + weight, in
 * float32), its rotary tables (local or global) and window, and its caches. */
typedef struct {
    StackLinear qkv, o, gate_up, down;
    const float *input_norm, *post_attention_norm, *pre_feedforward_norm, *post_feedforward_norm, *q_norm, *k_norm;
    const float *cos, *sin;
    void *k_cache, *v_cache;
    int64_t sliding_window;
    float eps, scale;
} GemmaLayer;

/* Row buffers of a Gemma layer, in the activations' dtype. */
typedef struct {
    char *x, *qkv, *qk, *q, *attended, *projected, *normed, *scratch;
} GemmaBuffers;

static void *allocate_gemma_buffers(const StackShape *s, int64_t tokens, GemmaBuffers *b) {
    const int64_t element = s->bf16 ? 2 : 4;
    const int64_t attention = s->num_heads * s->head_dim, kv = s->num_kv_heads * s->head_dim;
    const int64_t widest = 2 * s->intermediate_size > attention + 2 * kv ? 2 * s->intermediate_size : attention + 2 * kv;
    const int64_t per_token[8] = {s->hidden_size, attention + 2 * kv, attention + kv, attention, attention,
                                  s->hidden_size, s->hidden_size, widest};
    int64_t bytes = 0;
    for (int i = 0; i < 8; ++i) bytes += (tokens * per_token[i] * element + 63) / 64 * 64;
    char *base = aligned_alloc(64, bytes), *next = base;
    if (base == NULL) return NULL;
    char **buffers[8] = {&b->x, &b->qkv, &b->qk, &b->q, &b->attended, &b->projected, &b->normed, &b->scratch};
    for (int i = 0; i < 8; ++i) *buffers[i] = carve(&next, tokens * per_token[i], element);
    return base;
}

/* Finishes `previous`'s MLP where it is not NULL: hidden += post_feedforward_norm(down(activated)); then runs
 * `layer` (where not NULL) up to its gate_up product, into `gate_up` [tokens, 2 * intermediate_size]:
 *   x = input_norm(hidden); q, k, v = qkv(x); q, k = rotary(q_norm(q), k_norm(k)); K/V into the caches;
 *   hidden += post_attention_norm(o(attention)); gate_up = gate_up(pre_feedforward_norm(hidden)).
 * The gated activation between gate_up and down is the caller's (torch's GELU, whose rounding is its own).
 * Every step is the call models/gemma3.py's modules make on the fused CPU ops, in their order, and every sum
 * is rounded where their torch add rounds it: the result is theirs bit for bit. Activations in float32 or (the
 * shape's bf16) bfloat16. Returns 0 or decode_layer_stack's failure codes (*failed_part: 0 previous, 1 layer). */
int gemma_decode_layer(const GemmaLayer *previous, const void *activated, const GemmaLayer *layer,
                       const StackShape *s, const StackStep *step, ProductFunction product, void *hidden,
                       void *gate_up, int64_t *failed_part) {
    const int64_t tokens = step->tokens, hidden_size = s->hidden_size, head_dim = s->head_dim;
    const int64_t attention = s->num_heads * head_dim, kv = s->num_kv_heads * head_dim;
    const int64_t width = attention + 2 * kv, qk_width = attention + kv;
    const int bf16 = s->bf16;
    const int64_t element = bf16 ? 2 : 4;
    *failed_part = -1;
    if (tokens <= 0) return 0;
    GemmaBuffers b;
    void *base = allocate_gemma_buffers(s, tokens, &b);
    if (base == NULL) return DECODE_STACK_MEMORY;
    int failed = 0;
    if (previous != NULL) {
        *failed_part = 0;
        failed = linear(product, &previous->down, activated, tokens, s->intermediate_size, b.projected, b.scratch,
                        bf16);
        if (failed) {
            free(base);
            return DECODE_STACK_PRODUCT + failed;
        }
        gemma_rms_norm(b.projected, NULL, previous->post_feedforward_norm, b.normed, tokens, hidden_size,
                       previous->eps, bf16);
        add_into(hidden, b.normed, tokens * hidden_size, bf16);
    }
    if (layer != NULL) {
        *failed_part = 1;
        gemma_rms_norm(hidden, NULL, layer->input_norm, b.x, tokens, hidden_size, layer->eps, bf16);
        if ((failed = linear(product, &layer->qkv, b.x, tokens, hidden_size, b.qkv, b.scratch, bf16))) {
            failed += DECODE_STACK_PRODUCT;
            goto done;
        }
        /* Per-head norms, each head a row; the normed q and k side by side in qk, as the rotary kernel takes them. */
        for (int64_t t = 0; t < tokens; ++t) {
            gemma_rms_norm(b.qkv + t * width * element, NULL, layer->q_norm, b.qk + t * qk_width * element,
                           s->num_heads, head_dim, layer->eps, bf16);
            gemma_rms_norm(b.qkv + (t * width + attention) * element, NULL, layer->k_norm,
                           b.qk + (t * qk_width + attention) * element, s->num_kv_heads, head_dim, layer->eps, bf16);
        }
        rotary_inplace(b.qk, tokens, qk_width, s->num_heads + s->num_kv_heads, head_dim, layer->cos, layer->sin,
                       step->positions, bf16);
        write_kv(s, step, b.qk + attention * element, qk_width, b.qkv + (attention + kv) * element, width,
                 layer->k_cache, layer->v_cache);
        const char *q = queries(s, tokens, b.qk, qk_width, b.q);
        if ((failed = paged_decode_attention(q, layer->k_cache, layer->v_cache, s->kv_format, bf16,
                                             step->block_tables, step->table_stride, step->context_lens, b.attended,
                                             tokens, s->num_heads, s->num_kv_heads, head_dim, s->block_size,
                                             layer->scale, layer->sliding_window, NULL, 1))) {
            failed += DECODE_STACK_ATTENTION;
            goto done;
        }
        if ((failed = linear(product, &layer->o, b.attended, tokens, attention, b.projected, b.scratch, bf16))) {
            failed += DECODE_STACK_PRODUCT;
            goto done;
        }
        gemma_rms_norm(b.projected, NULL, layer->post_attention_norm, b.normed, tokens, hidden_size, layer->eps,
                       bf16);
        gemma_rms_norm(b.normed, hidden, layer->pre_feedforward_norm, b.x, tokens, hidden_size, layer->eps, bf16);
        if ((failed = linear(product, &layer->gate_up, b.x, tokens, hidden_size, gate_up, b.scratch, bf16)))
            failed += DECODE_STACK_PRODUCT;
    }
done:
    if (!failed) *failed_part = -1;
    free(base);
    return failed;
}
