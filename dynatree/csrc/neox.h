/* The library's interface: the forward's parameter and dimension indices, the description of one
 * sequence of a packed forward (dt_seq; dynatree/native.py mirrors it as DtSeq, checked against
 * dt_seq_bytes), and every exported function -- included by the sources that define them, so the
 * compiler checks each definition, and by C callers (tests/kernel_bits.c). */
#ifndef DT_NEOX_H
#define DT_NEOX_H

/* QN_W, KN_W: per-head RMS norm weights of q and k (Qwen3), NULL for none; *_B NULL: no bias. */
enum { LN1_W, LN1_B, LN2_W, LN2_B, QKV_W, QKV_B, OUT_W, OUT_B, FC1_W, FC1_B, FC2_W, FC2_B, QN_W, KN_W, NPARAM };
enum { D_MODEL, HEADS, HEAD_DIM, ROT, FF, PARALLEL, ACT, VOCAB_PAD, EMBED_ROWS, WFMT, KV_HEADS, NORM, NDIM };  /* WFMT: see dt_gemm */
enum { ACT_GELU = 1, ACT_RELU = 2, ACT_SWIGLU = 3 }; /* SWIGLU: fc1 gives [gate | up] (2 ff), g = silu(gate) * up */
enum { NORM_LAYER = 0, NORM_RMS = 1 };

/* One sequence's part of a packed forward: `rows` consecutive rows of the batch, after `past`
 * cached tokens.  Its rows see keys j < visible and, for j >= visible, those marked in allowed
 * (rows, past + rows - visible) bool, row-major; allowed NULL = causal.  kc[l], vc[l]: the
 * sequence's own (H, cap, hd) key/value buffers of layer l -- rows never see another
 * sequence's keys.  The logits of its last `keep` rows are returned.  noise (sampling, NULL for
 * none): one row of Gumbel noise per kept row, and the heads read (and the logits return) the
 * perturbed scores logits * inv_temp + noise (perturb_row). */
typedef struct {
    long rows, past, visible, cap, keep;
    const unsigned char *allowed;
    void *const *kc;
    void *const *vc;
    long kvfmt; /* cache element: 0 float32, 1 bfloat16 (rounded to nearest even as it is written) */
    const float *const *noise;
    float inv_temp;
    long nshare;            /* the first ends[nshare - 1] keys are read in pieces from prefix.py's copy of a */
    const long *ends;       /* prompt prefix other sequences share (the same values, so the same bits, read */
    void *const *ks;        /* from one place): piece p of layer l at ks[l * nshare + p], vs[...], the key */
    void *const *vs;        /* at the piece's start in a (KV heads, scaps[p], hd) buffer; see attn.h */
    const long *scaps;
} dt_seq;

/* Every function the library exports (native.py declares them for ctypes): gemm.c's, then neox.c's. */
const char *dt_isa(void);
int dt_vector_floats(void);
int dt_rows_per_pass(void);
int dt_tile_width(void);
void dt_gemm_for(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N,
                 void *xbuf);
int dt_bf16_dot(void);
double dt_dot_peak(long iters, int threads);
long dt_bf16c_buffer_bytes(long M, long K);
void dt_gemm(const float *x, long M, long K, const void *wp, int fmt, const float *bp, float *y, long N,
             int threads);
double dt_fma_peak(long iters, int threads);
int dt_attn_supported(long head_dim);
long dt_seq_bytes(void);
long dt_work_per_row(const long *dims);
int dt_neox_forward(const long *dims, float eps, float scaling, long nlayers, const float *const *p,
                    const float *embed, const float *const *head, const long *ids, long n, const long *pos,
                    const float *cos_t, const float *sin_t, const dt_seq *seqs, long nseq, float *logits,
                    float *work, int threads, long cols, long topk, float *top_vals, long *top_ids);
void dt_argmax(const float *logits, long n, long V, long stride, long *out);
void dt_gumbel(unsigned int k0, unsigned int k1, long n, float *out);
void dt_softmax_topk(const float *logits, long n, long V, long stride, long k, float *vals, long *ids);
void dt_cache_keep(char *const *kc, char *const *vc, long nl, long rows, long cap, long hd, long start,
                   const long *src, long k, long elem);
#endif
