// Microbenchmark of llama.cpp's CPU matrix-vector kernels on a model's real weights (issue 57).
//
// For each named tensor of a GGUF file: the tensor's bytes are loaded into a ggml CPU buffer (the
// repacking buffer for the types llama.cpp repacks on this CPU, as a model load does), copied enough
// times to exceed the last-level cache (so every pass streams the weights from memory, as a decode
// does), and `ggml_mul_mat` of every copy with the same f32 activations of N rows is timed through
// `ggml_backend_graph_compute` (the activations' quantization to Q8_K included, as in a decode).
// Optionally checks that every row of an N-row product has the bits of the one-row product of that
// row (--check). Also measures the two floors: the memory bandwidth of a plain read of the same
// bytes on the same threads, and the int8 multiply-add rate of `vpmaddubsw` (AVX2, ymm).
//
// Built and run by scripts/kernel_bench.py against a given libggml-cpu (stock, patched, a candidate).

#define _GNU_SOURCE
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void * a, const void * b) {
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

// ---- floors ---------------------------------------------------------------------------------

typedef struct {
    const uint8_t * p;
    size_t          n;
    int             reps;
    long long       sink;
} read_arg;

static void * read_worker(void * v) {
    read_arg * a = v;
    __m256i    acc = _mm256_setzero_si256();
    for (int r = 0; r < a->reps; r++) {
        for (size_t i = 0; i + 128 <= a->n; i += 128) {
            acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *) (a->p + i)));
            acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *) (a->p + i + 32)));
            acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *) (a->p + i + 64)));
            acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *) (a->p + i + 96)));
        }
    }
    a->sink = _mm256_extract_epi64(acc, 0);
    return NULL;
}

// GB/s of `nthreads` threads each reading its half of a `bytes` buffer (beyond the caches)
static double read_bandwidth(size_t bytes, int nthreads) {
    uint8_t * buf = aligned_alloc(64, bytes);
    memset(buf, 1, bytes);
    pthread_t th[64];
    read_arg  args[64];
    double    best = 0;
    for (int trial = 0; trial < 5; trial++) {
        double t0 = now_s();
        for (int i = 0; i < nthreads; i++) {
            args[i] = (read_arg){ buf + bytes / nthreads * i, bytes / nthreads, 1, 0 };
            pthread_create(&th[i], NULL, read_worker, &args[i]);
        }
        for (int i = 0; i < nthreads; i++) {
            pthread_join(th[i], NULL);
        }
        double gbs = bytes / (now_s() - t0) / 1e9;
        best = gbs > best ? gbs : best;
    }
    free(buf);
    return best;
}

typedef struct {
    long long iters;
    long long sink;
} mac_arg;

static void * mac_worker(void * v) {
    mac_arg * a = v;
    __m256i   x = _mm256_set1_epi8(5);
    __m256i   c0 = _mm256_set1_epi8(1), c1 = _mm256_set1_epi8(2), c2 = _mm256_set1_epi8(3), c3 = _mm256_set1_epi8(4);
    __m256i   c4 = _mm256_set1_epi8(5), c5 = _mm256_set1_epi8(6), c6 = _mm256_set1_epi8(7), c7 = _mm256_set1_epi8(8);
    __m256i   c8 = _mm256_set1_epi8(9), c9 = _mm256_set1_epi8(10), c10 = _mm256_set1_epi8(11), c11 = _mm256_set1_epi8(12);
    for (long long i = 0; i < a->iters; i++) {
        // twelve independent chains, each vpmaddubsw fed by its own last result: throughput, not
        // latency, and nothing the compiler can hoist out of the loop
        c0 = _mm256_maddubs_epi16(c0, x);
        c1 = _mm256_maddubs_epi16(c1, x);
        c2 = _mm256_maddubs_epi16(c2, x);
        c3 = _mm256_maddubs_epi16(c3, x);
        c4 = _mm256_maddubs_epi16(c4, x);
        c5 = _mm256_maddubs_epi16(c5, x);
        c6 = _mm256_maddubs_epi16(c6, x);
        c7 = _mm256_maddubs_epi16(c7, x);
        c8 = _mm256_maddubs_epi16(c8, x);
        c9 = _mm256_maddubs_epi16(c9, x);
        c10 = _mm256_maddubs_epi16(c10, x);
        c11 = _mm256_maddubs_epi16(c11, x);
        __asm__ volatile("" : "+x"(x));
    }
    __m256i s = _mm256_xor_si256(_mm256_xor_si256(_mm256_xor_si256(c0, c1), _mm256_xor_si256(c2, c3)),
                                 _mm256_xor_si256(_mm256_xor_si256(c4, c5), _mm256_xor_si256(c6, c7)));
    s = _mm256_xor_si256(s, _mm256_xor_si256(_mm256_xor_si256(c8, c9), _mm256_xor_si256(c10, c11)));
    a->sink = _mm256_extract_epi64(s, 0);
    return NULL;
}

// int8 multiply-adds per second of `vpmaddubsw ymm` (32 per instruction) on `nthreads` threads
static double maddubs_rate(int nthreads) {
    pthread_t th[64];
    mac_arg   args[64];
    double    best = 0;
    long long iters = 10000000;
    for (int trial = 0; trial < 3; trial++) {
        double t0 = now_s();
        for (int i = 0; i < nthreads; i++) {
            args[i] = (mac_arg){ iters, 0 };
            pthread_create(&th[i], NULL, mac_worker, &args[i]);
        }
        for (int i = 0; i < nthreads; i++) {
            pthread_join(th[i], NULL);
        }
        double rate = (double) iters * 12 * 32 * nthreads / (now_s() - t0);
        best = rate > best ? rate : best;
    }
    return best;
}

// ---- the model's tensors ------------------------------------------------------------------------

static ggml_backend_buffer_type_t repack_buft(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get) {
        return NULL;
    }
    for (ggml_backend_buffer_type_t * b = get(dev); b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return NULL;
}

typedef struct {
    int64_t        ne0, ne1;
    enum ggml_type type;
    size_t         nbytes;
    void *         data;
} host_tensor;

// Whether this build's repacking buffer takes the tensor, asked as a model load asks (llama.cpp's
// weight_buft_supported): can the device run a matrix product whose weight sits in such a buffer.
// Each build answers for itself (edgespec's patch 0012 adds Q4_1; stock builds do not).
static int repacks(ggml_backend_dev_t dev, ggml_backend_buffer_type_t rbt, const host_tensor * h) {
    struct ggml_init_params ip = { .mem_size = 4 * ggml_tensor_overhead(), .no_alloc = true };
    struct ggml_context *   ctx = ggml_init(ip);
    struct ggml_tensor *    w = ggml_new_tensor_2d(ctx, h->type, h->ne0, h->ne1);
    struct ggml_tensor *    op = ggml_mul_mat(ctx, w, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, h->ne0, 1));
    ggml_backend_buffer_t   buf = ggml_backend_buft_alloc_buffer(rbt, 0);
    w->buffer = buf;
    const int ok = ggml_backend_dev_supports_op(dev, op);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return ok;
}

// the tensor's first `slice` rows (all if 0; -K: K KB of rows): a slice that fits the caches times the arithmetic alone
static int load_tensor(const char * path, const char * name, int64_t slice, host_tensor * out) {
    struct ggml_context *   meta = NULL;
    struct gguf_init_params p = { .no_alloc = true, .ctx = &meta };
    struct gguf_context *   g = gguf_init_from_file(path, p);
    if (!g) {
        fprintf(stderr, "cannot read %s\n", path);
        return 1;
    }
    int64_t id = gguf_find_tensor(g, name);
    if (id < 0) {
        fprintf(stderr, "no tensor %s in %s\n", name, path);
        return 1;
    }
    struct ggml_tensor * t = ggml_get_tensor(meta, name);
    out->ne0 = t->ne[0];
    if (slice < 0) {
        // -slice KB of rows, in whole groups of 16 rows
        slice = (-slice * 1024 / (int64_t) ggml_row_size(t->type, t->ne[0])) / 16 * 16;
        slice = slice < 16 ? 16 : slice;
    }
    out->ne1 = slice > 0 && slice < t->ne[1] ? slice : t->ne[1];
    out->type = t->type;
    out->nbytes = ggml_row_size(t->type, t->ne[0]) * out->ne1;
    out->data = malloc(out->nbytes);
    FILE * f = fopen(path, "rb");
    fseeko(f, (off_t) (gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id)), SEEK_SET);
    size_t got = fread(out->data, 1, out->nbytes, f);
    fclose(f);
    gguf_free(g);
    ggml_free(meta);
    return got == out->nbytes ? 0 : 1;
}

// ---- the benchmark ------------------------------------------------------------------------------

typedef struct {
    struct ggml_context * ctx, * actx;
    ggml_backend_buffer_t wbuf, abuf;
    struct ggml_cgraph *  graph;
    struct ggml_tensor *  x;
    struct ggml_tensor ** out;
    int                   copies;
} bench_graph;

static void build(bench_graph * bg, ggml_backend_buffer_type_t wbt, const host_tensor * h, int copies, int rows) {
    struct ggml_init_params ip = { .mem_size = ggml_tensor_overhead() * (2 * copies + 8) + ggml_graph_overhead_custom(
                                                                                                4 * copies + 16, false),
                                   .no_alloc = true };
    bg->ctx = ggml_init(ip);
    bg->copies = copies;
    struct ggml_tensor ** w = calloc(copies, sizeof(*w));
    for (int c = 0; c < copies; c++) {
        w[c] = ggml_new_tensor_2d(bg->ctx, h->type, h->ne0, h->ne1);
    }
    bg->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(bg->ctx, wbt);
    for (int c = 0; c < copies; c++) {
        ggml_backend_tensor_set(w[c], h->data, 0, h->nbytes);  // repacks, where the buffer repacks
    }
    struct ggml_context * actx = bg->actx = ggml_init(ip);
    bg->x = ggml_new_tensor_2d(actx, GGML_TYPE_F32, h->ne0, rows);
    bg->out = calloc(copies, sizeof(*bg->out));
    bg->graph = ggml_new_graph_custom(actx, 4 * copies + 16, false);
    for (int c = 0; c < copies; c++) {
        bg->out[c] = ggml_mul_mat(actx, w[c], bg->x);
        ggml_build_forward_expand(bg->graph, bg->out[c]);
    }
    bg->abuf = ggml_backend_alloc_ctx_tensors_from_buft(actx, ggml_backend_cpu_buffer_type());
    free(w);
}

static void release(bench_graph * bg) {
    ggml_backend_buffer_free(bg->wbuf);
    ggml_backend_buffer_free(bg->abuf);
    ggml_free(bg->ctx);
    ggml_free(bg->actx);
    free(bg->out);
}

static void set_rows(bench_graph * bg, const float * x, int rows) {
    ggml_backend_tensor_set(bg->x, x, 0, sizeof(float) * bg->x->ne[0] * rows);
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr,
                "usage: %s MODEL.gguf TENSOR[,TENSOR...] [--rows 1,2,3,4,8] [--threads 2] [--reps 20] [--mb 512] "
                "[--slice ROWS] [--check] [--floors | --floors-only]\n",
                argv[0]);
        return 2;
    }
    const char * model = argv[1];
    char *       names = strdup(argv[2]);
    const char * rows_arg = "1,2,3,4,8";
    int          nthreads = 2, reps = 20, check = 0, floors = 0;
    int64_t      slice = 0;
    double       mb = 512;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--rows")) {
            rows_arg = argv[++i];
        } else if (!strcmp(argv[i], "--threads")) {
            nthreads = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--reps")) {
            reps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--mb")) {
            mb = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--slice")) {
            slice = atoll(argv[++i]);
        } else if (!strcmp(argv[i], "--check")) {
            check = 1;
        } else if (!strcmp(argv[i], "--floors")) {
            floors = 1;
        } else if (!strcmp(argv[i], "--floors-only")) {
            floors = 2;
        }
    }
    int  rows[64], nrows = 0;
    char rbuf[256];
    snprintf(rbuf, sizeof rbuf, "%s", rows_arg);
    for (char * tok = strtok(rbuf, ","); tok && nrows < 64; tok = strtok(NULL, ",")) {
        rows[nrows++] = atoi(tok);
    }
    int max_rows = 1;
    for (int i = 0; i < nrows; i++) {
        max_rows = rows[i] > max_rows ? rows[i] : max_rows;
    }

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, nthreads);
    ggml_backend_dev_t         dev = ggml_backend_get_device(backend);
    ggml_backend_buffer_type_t rbt = repack_buft(dev);

    printf("{\"threads\": %d", nthreads);
    if (floors) {
        printf(", \"read_gbs\": %.2f, \"maddubs_gmacs\": %.1f", read_bandwidth((size_t) 1 << 30, nthreads),
               maddubs_rate(nthreads) / 1e9);
        if (floors == 2) {
            printf("}\n");
            return 0;
        }
    }
    printf(", \"tensors\": [");
    int first = 1;
    for (char * name = strtok(names, ","); name; name = strtok(NULL, ",")) {
        host_tensor h;
        if (load_tensor(model, name, slice, &h)) {
            return 1;
        }
        // the repacking buffer takes what it repacks on this CPU, the plain CPU buffer the rest
        ggml_backend_buffer_type_t wbt = ggml_backend_cpu_buffer_type();
        int                        repacked = 0;
        if (rbt && repacks(dev, rbt, &h)) {
            wbt = rbt;
            repacked = 1;
        }
        int copies = (int) ceil(mb * 1e6 / h.nbytes);
        copies = copies < 1 ? 1 : copies;

        srand(1234);
        float * x = malloc(sizeof(float) * h.ne0 * max_rows);
        for (int64_t i = 0; i < h.ne0 * max_rows; i++) {
            x[i] = (float) rand() / RAND_MAX * 2.f - 1.f;
        }
        printf("%s{\"name\": \"%s\", \"type\": \"%s\", \"ne\": [%lld, %lld], \"bytes\": %zu, \"repacked\": %s, "
               "\"copies\": %d, \"ms\": {",
               first ? "" : ", ", name, ggml_type_name(h.type), (long long) h.ne0, (long long) h.ne1, h.nbytes,
               repacked ? "true" : "false", copies);
        first = 0;
        float * one = NULL;
        if (check) {
            // one-row results of every row, the reference for --check
            bench_graph bg;
            build(&bg, wbt, &h, 1, 1);
            one = malloc(sizeof(float) * h.ne1 * max_rows);
            for (int r = 0; r < max_rows; r++) {
                set_rows(&bg, x + h.ne0 * r, 1);
                ggml_backend_graph_compute(backend, bg.graph);
                ggml_backend_tensor_get(bg.out[0], one + h.ne1 * r, 0, sizeof(float) * h.ne1);
            }
            release(&bg);
        }
        for (int ri = 0; ri < nrows; ri++) {
            int         n = rows[ri];
            bench_graph bg;
            build(&bg, wbt, &h, copies, n);
            set_rows(&bg, x, n);
            double * t = malloc(sizeof(double) * reps);
            double * c = malloc(sizeof(double) * reps);
            ggml_backend_graph_compute(backend, bg.graph);  // warm up
            for (int k = 0; k < reps; k++) {
                double t0 = now_s(), c0 = thread_cpu_s();
                ggml_backend_graph_compute(backend, bg.graph);
                t[k] = (now_s() - t0) / copies * 1e3;
                c[k] = (thread_cpu_s() - c0) / copies * 1e3;
            }
            qsort(t, reps, sizeof(double), cmp_double);
            qsort(c, reps, sizeof(double), cmp_double);
            long long mismatches = -1;
            if (check) {
                mismatches = 0;
                float * res = malloc(sizeof(float) * h.ne1 * n);
                ggml_backend_tensor_get(bg.out[0], res, 0, sizeof(float) * h.ne1 * n);
                for (int64_t i = 0; i < h.ne1 * n; i++) {
                    mismatches += memcmp(&res[i], &one[i], sizeof(float)) != 0;
                }
                free(res);
            }
            // the calling thread's CPU time: with one thread, what the kernels cost whatever else runs
            printf("%s\"%d\": {\"median\": %.4f, \"min\": %.4f, \"cpu_median\": %.4f, \"cpu_min\": %.4f%s",
                   ri ? ", " : "", n, t[reps / 2], t[0], c[reps / 2], c[0], check ? ", \"mismatches\": " : "");
            if (check) {
                printf("%lld", mismatches);
            }
            printf("}");
            fflush(stdout);
            free(t);
            free(c);
            release(&bg);
        }
        printf("}}");
        free(one);
        free(x);
        free(h.data);
    }
    printf("]}\n");
    ggml_backend_free(backend);
    return 0;
}
