/* Byte-fallback BPE over a vocabulary and merge table held in flat arrays (pagellm/tokenization/compact_bpe.py).

The merge order is HuggingFace tokenizers' (models/bpe/word.rs, merge_all): the adjacent pair of lowest merge rank
is merged first, the leftmost of equal ranks, until no adjacent pair has a merge. A character the vocabulary lacks
becomes its UTF-8 bytes' <0xXX> tokens where all of them exist, else the unknown token (consecutive unknowns fused
into one, as fuse_unk does). The arrays are only read, so any number of threads may encode at once. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint8_t *token_bytes;   /* every token's UTF-8, back to back */
    const int32_t *token_offsets; /* [n_tokens + 1] */
    int32_t n_tokens;
    const int32_t *slots; /* open-addressing index of the tokens' bytes: a token id or -1 */
    int64_t n_slots;      /* a power of two */
    /* Merges by left token (CSR): row `left` is [merge_offsets[left], merge_offsets[left + 1]), its right tokens
       ascending, each with the merge's rank and the token it makes. */
    const int32_t *merge_offsets;
    const int32_t *merge_right;
    const int32_t *merge_rank;
    const int32_t *merge_result;
    const int32_t *byte_tokens; /* [256] the <0xXX> token of each byte, or -1 */
    int32_t unk_id;             /* -1 where the vocabulary has none */
} BpeModel;

static uint64_t hash_bytes(const uint8_t *s, int64_t len) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (int64_t i = 0; i < len; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* Fills `slots` (n_slots, a power of two at least twice n_tokens, preset to -1). The first id of a repeated string keeps
   the slot, as a dict built from the vocabulary in id order would not: the caller passes unique strings. */
void bpe_build_index(const uint8_t *token_bytes, const int32_t *token_offsets, int32_t n_tokens, int32_t *slots,
                     int64_t n_slots) {
    for (int32_t id = 0; id < n_tokens; id++) {
        const uint8_t *s = token_bytes + token_offsets[id];
        int64_t len = token_offsets[id + 1] - token_offsets[id];
        uint64_t slot = hash_bytes(s, len) & (uint64_t)(n_slots - 1);
        while (slots[slot] >= 0) slot = (slot + 1) & (uint64_t)(n_slots - 1);
        slots[slot] = id;
    }
}

int32_t bpe_lookup(const BpeModel *m, const uint8_t *s, int64_t len) {
    uint64_t slot = hash_bytes(s, len) & (uint64_t)(m->n_slots - 1);
    for (;;) {
        int32_t id = m->slots[slot];
        if (id < 0) return -1;
        int64_t start = m->token_offsets[id];
        if (m->token_offsets[id + 1] - start == len && memcmp(m->token_bytes + start, s, (size_t)len) == 0)
            return id;
        slot = (slot + 1) & (uint64_t)(m->n_slots - 1);
    }
}

/* The merge of (left, right): its index in the merge arrays, or -1. */
static int64_t find_merge(const BpeModel *m, int32_t left, int32_t right) {
    int64_t lo = m->merge_offsets[left], hi = m->merge_offsets[left + 1];
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int32_t r = m->merge_right[mid];
        if (r == right) return mid;
        if (r < right) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

static int64_t utf8_length(uint8_t lead) {
    if (lead < 0x80) return 1;
    if ((lead & 0xE0) == 0xC0) return 2;
    if ((lead & 0xF0) == 0xE0) return 3;
    if ((lead & 0xF8) == 0xF0) return 4;
    return 1; /* not a lead byte: the caller passes valid UTF-8, so this is never reached */
}

typedef struct {
    int32_t id;
    int32_t prev, next; /* symbol indices, -1 at the ends */
    int32_t alive;
} Symbol;

typedef struct {
    int32_t rank;
    int32_t pos;
    int32_t result;
} Candidate;

/* A min-heap on (rank, pos): the lowest rank first, the leftmost of equal ranks. */
static int candidate_before(const Candidate *a, const Candidate *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(Candidate *heap, int64_t *size, Candidate c) {
    int64_t i = (*size)++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!candidate_before(&c, &heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = c;
}

static Candidate heap_pop(Candidate *heap, int64_t *size) {
    Candidate top = heap[0], last = heap[--(*size)];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= *size) break;
        if (child + 1 < *size && candidate_before(&heap[child + 1], &heap[child])) child++;
        if (!candidate_before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*size > 0) heap[i] = last;
    return top;
}

static void push_pair(const BpeModel *m, const Symbol *symbols, int32_t pos, Candidate *heap, int64_t *size) {
    int32_t next = symbols[pos].next;
    if (next < 0) return;
    int64_t merge = find_merge(m, symbols[pos].id, symbols[next].id);
    if (merge >= 0) heap_push(heap, size, (Candidate){m->merge_rank[merge], pos, m->merge_result[merge]});
}

/* Encodes `len` bytes of normalized UTF-8 (one pre-token) into at most `len` ids in `out`; returns their count, or
   -1 when out of memory. */
static int64_t encode_piece(const BpeModel *m, const uint8_t *text, int64_t len, int32_t *out) {
    if (len == 0) return 0;
    Symbol *symbols = malloc(sizeof(Symbol) * (size_t)len);
    /* Each merge pushes at most two candidates and there are fewer merges than symbols. */
    Candidate *heap = malloc(sizeof(Candidate) * (size_t)(3 * len + 1));
    if (symbols == NULL || heap == NULL) {
        free(symbols);
        free(heap);
        return -1;
    }
    int32_t n = 0;
    int pending_unk = 0;
    for (int64_t i = 0; i < len;) {
        int64_t width = utf8_length(text[i]);
        if (i + width > len) width = len - i;
        int32_t id = bpe_lookup(m, text + i, width);
        if (id >= 0) {
            if (pending_unk) symbols[n++].id = m->unk_id;
            pending_unk = 0;
            symbols[n++].id = id;
        } else {
            int all_bytes = 1;
            for (int64_t b = 0; b < width; b++) all_bytes &= m->byte_tokens[text[i + b]] >= 0;
            if (all_bytes) {
                /* As tokenizers does: the bytes go in without ending a pending unknown. */
                for (int64_t b = 0; b < width; b++) symbols[n++].id = m->byte_tokens[text[i + b]];
            } else if (m->unk_id >= 0) {
                pending_unk = 1;
            }
        }
        i += width;
    }
    if (pending_unk) symbols[n++].id = m->unk_id;
    for (int32_t k = 0; k < n; k++) {
        symbols[k].prev = k - 1;
        symbols[k].next = k + 1 < n ? k + 1 : -1;
        symbols[k].alive = 1;
    }
    int64_t size = 0;
    for (int32_t k = 0; k + 1 < n; k++) push_pair(m, symbols, k, heap, &size);
    while (size > 0) {
        Candidate top = heap_pop(heap, &size);
        Symbol *left = &symbols[top.pos];
        if (!left->alive || left->next < 0) continue;
        Symbol *right = &symbols[left->next];
        /* A stale candidate: one of its symbols has merged since it was pushed. */
        int64_t merge = find_merge(m, left->id, right->id);
        if (merge < 0 || m->merge_result[merge] != top.result) continue;
        left->id = top.result;
        right->alive = 0;
        left->next = right->next;
        if (right->next >= 0) symbols[right->next].prev = top.pos;
        if (left->prev >= 0) push_pair(m, symbols, left->prev, heap, &size);
        push_pair(m, symbols, top.pos, heap, &size);
    }
    int64_t count = 0;
    for (int32_t k = 0; k >= 0 && k < n; k = symbols[k].next) out[count++] = symbols[k].id;
    free(symbols);
    free(heap);
    return count;
}

/* Encodes the consecutive pieces of `text` (pre-tokenized words, piece p ending at ends[p]) each on its own, as
   tokenizers encodes each pre-token; with ignore_merges, a piece the vocabulary holds whole is that token. Returns
   the ids' count (at most the text's length), or -1 when out of memory. */
int64_t bpe_encode_pieces(const BpeModel *m, const uint8_t *text, const int64_t *ends, int64_t n_pieces,
                          int32_t ignore_merges, int32_t *out) {
    int64_t count = 0, start = 0;
    for (int64_t p = 0; p < n_pieces; p++) {
        const int64_t len = ends[p] - start;
        const int32_t whole = ignore_merges ? bpe_lookup(m, text + start, len) : -1;
        if (whole >= 0) {
            out[count++] = whole;
        } else {
            const int64_t got = encode_piece(m, text + start, len, out + count);
            if (got < 0) return -1;
            count += got;
        }
        start = ends[p];
    }
    return count;
}

/* Length of the valid UTF-8 sequence at s[0..len), or 0 where it is not one (Rust's str::from_utf8 rules: no
   overlong forms, no surrogates, nothing above U+10FFFF). */
static int64_t utf8_valid_prefix(const uint8_t *s, int64_t len) {
    uint8_t c = s[0];
    int64_t width;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) width = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        width = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        width = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    if (len < width || s[1] < lo || s[1] > hi) return 0;
    for (int64_t k = 2; k < width; k++)
        if (s[k] < 0x80 || s[k] > 0xBF) return 0;
    return width;
}

static int run_is_utf8(const uint8_t *s, int64_t len) {
    for (int64_t i = 0; i < len;) {
        int64_t width = utf8_valid_prefix(s + i, len - i);
        if (width == 0) return 0;
        i += width;
    }
    return 1;
}

/* Appends a run of fallback bytes: as they are where they form UTF-8, else one U+FFFD per byte (tokenizers'
   ByteFallback decoder). */
static int64_t flush_bytes(const uint8_t *run, int64_t n_run, uint8_t *out, int64_t count) {
    if (run_is_utf8(run, n_run)) {
        memcpy(out + count, run, (size_t)n_run);
        return count + n_run;
    }
    for (int64_t k = 0; k < n_run; k++) {
        out[count++] = 0xEF;
        out[count++] = 0xBF;
        out[count++] = 0xBD;
    }
    return count;
}

/* The text of `n` ids, all below n_tokens, as tokenizers' decoder chain Replace("\u2581", " "), ByteFallback, Fuse
   makes it, written to `out` (room for n * max(3, longest token) bytes); ids whose `skip` entry is set are left
   out first. `byte_values` [n_tokens] is the byte of each <0xXX> token, or -1. Returns the length in bytes, or -1
   when out of memory. */
int64_t bpe_decode(const BpeModel *m, const int16_t *byte_values, const uint8_t *skip, const int32_t *ids, int64_t n,
                   uint8_t *out) {
    uint8_t *run = malloc((size_t)(n > 0 ? n : 1));
    if (run == NULL) return -1;
    int64_t count = 0, n_run = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (skip != NULL && skip[id]) continue;
        if (byte_values[id] >= 0) {
            run[n_run++] = (uint8_t)byte_values[id];
            continue;
        }
        if (n_run > 0) count = flush_bytes(run, n_run, out, count);
        n_run = 0;
        const uint8_t *s = m->token_bytes + m->token_offsets[id];
        int64_t len = m->token_offsets[id + 1] - m->token_offsets[id];
        for (int64_t k = 0; k < len;) {
            if (k + 3 <= len && s[k] == 0xE2 && s[k + 1] == 0x96 && s[k + 2] == 0x81) { /* U+2581 */
                out[count++] = ' ';
                k += 3;
            } else {
                out[count++] = s[k++];
            }
        }
    }
    if (n_run > 0) count = flush_bytes(run, n_run, out, count);
    free(run);
    return count;
}
