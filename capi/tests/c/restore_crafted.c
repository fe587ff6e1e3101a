/*
 * A host restoring session files it did not write, through
 * q3w_model_restore_session: each must come back as a status, never abort
 * or hang the process.
 *
 *   restore_crafted CHECKPOINT_DIR SCRATCH_DIR
 *
 * The checkpoint has 2 layers of 2 KV heads of dimension 64 and 4,096
 * positions. Writes, in SCRATCH_DIR, a 100-byte file whose header claims
 * 0 layers of 2^20 heads of dimension 2^21 (8 TiB a layer), one with this
 * model's shape claiming 4,000 positions in 100 bytes, a FIFO, a link to
 * /dev/zero, a saved session and the same truncated by a byte; prints
 * "<name>: <status name>" for each restore (and for a missing file), and
 * checks that a refused restore leaves the output session NULL and names
 * the file in its message.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qwen3_wgpu.h"

#define CHECK(call)                                                                   \
    do {                                                                              \
        q3w_status status_ = (call);                                                  \
        if (status_ != Q3W_OK) {                                                      \
            fprintf(stderr, "%s:%d: error [%s]: %s\n", __FILE__, __LINE__,            \
                    q3w_status_name(status_), q3w_last_error_message());              \
            goto done;                                                                \
        }                                                                             \
    } while (0)

static void put_u32(unsigned char *at, uint32_t v) {
    for (int i = 0; i < 4; i++) at[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *at, uint64_t v) {
    for (int i = 0; i < 8; i++) at[i] = (unsigned char)(v >> (8 * i));
}

/* A 100-byte session file (format version 1): the header's fields, one
 * token id, a zero checksum and the end magic. */
static int write_crafted(const char *path, const char *fingerprint, uint32_t layers, uint32_t heads,
                         uint32_t head_dim, uint64_t capacity, uint64_t len) {
    unsigned char b[100] = {0};
    memcpy(b, "Q3WSESSN", 8);
    put_u32(b + 8, 1);
    memcpy(b + 16, fingerprint, 32);
    put_u32(b + 48, layers);
    put_u32(b + 52, heads);
    put_u32(b + 56, head_dim);
    put_u64(b + 64, capacity);
    put_u64(b + 72, len);
    memcpy(b + 92, "Q3WSEND", 8); /* with its NUL */
    FILE *f = fopen(path, "wb");
    if (f == NULL) return -1;
    size_t n = fwrite(b, 1, sizeof b, f);
    return fclose(f) == 0 && n == sizeof b ? 0 : -1;
}

/* Copies `from` to `to` without its last byte. */
static int write_truncated(const char *from, const char *to) {
    FILE *in = fopen(from, "rb");
    if (in == NULL) return -1;
    fseek(in, 0, SEEK_END);
    long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    unsigned char *bytes = malloc((size_t)size);
    size_t n = fread(bytes, 1, (size_t)size, in);
    fclose(in);
    FILE *out = fopen(to, "wb");
    int ok = out != NULL && n == (size_t)size && fwrite(bytes, 1, (size_t)size - 1, out) == (size_t)size - 1;
    if (out != NULL && fclose(out) != 0) ok = 0;
    free(bytes);
    return ok ? 0 : -1;
}

/* Restores `dir/name`, prints the status's name; a refusal must leave
 * `out` NULL and name the file. Returns 0 when it did. */
static int restore(const q3w_model *model, const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    q3w_session *session = (q3w_session *)path; /* must be reset */
    q3w_status status = q3w_model_restore_session(model, path, 0, &session);
    printf("%s: %s\n", name, q3w_status_name(status));
    if (status == Q3W_OK) {
        q3w_session_free(session);
        return 0;
    }
    if (session != NULL) {
        fprintf(stderr, "%s: a failed restore left a session\n", name);
        return -1;
    }
    if (strstr(q3w_last_error_message(), name) == NULL) {
        fprintf(stderr, "%s: the message does not name the file: %s\n", name, q3w_last_error_message());
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CHECKPOINT_DIR SCRATCH_DIR\n", argv[0]);
        return 2;
    }
    /* A restore that never returns fails the run instead of hanging it. */
    alarm(120);
    const char *dir = argv[2];
    int exit_code = 1;
    char path[4096], other[4096];
    q3w_engine *engine = NULL;
    q3w_model *model = NULL;
    q3w_session *session = NULL;
    char *fingerprint = NULL;
    size_t fingerprint_len = 0;

    CHECK(q3w_engine_new(NULL, &engine));
    q3w_load_options load_options;
    CHECK(q3w_load_options_init(&load_options, sizeof load_options));
    load_options.cache_policy = Q3W_CACHE_DISABLED;
    CHECK(q3w_model_load(engine, argv[1], &load_options, &model));
    CHECK(q3w_model_fingerprint(model, &fingerprint, &fingerprint_len));
    if (fingerprint_len != 32) goto done;

    snprintf(path, sizeof path, "%s/huge_layer.q3s", dir);
    if (write_crafted(path, fingerprint, 0, 1u << 20, 1u << 21, 1, 1) != 0) goto done;
    snprintf(path, sizeof path, "%s/short.q3s", dir);
    if (write_crafted(path, fingerprint, 2, 2, 64, 4096, 4000) != 0) goto done;
    snprintf(path, sizeof path, "%s/fifo.q3s", dir);
    if (mkfifo(path, 0600) != 0) goto done;
    snprintf(path, sizeof path, "%s/zero.q3s", dir);
    if (symlink("/dev/zero", path) != 0) goto done;

    q3w_session_options session_options;
    CHECK(q3w_session_options_init(&session_options, sizeof session_options));
    session_options.capacity = 16;
    CHECK(q3w_session_new(model, &session_options, &session));
    const uint32_t prompt[3] = {5, 6, 7};
    uint32_t token;
    CHECK(q3w_session_feed(session, prompt, 3, &token));
    snprintf(path, sizeof path, "%s/saved.q3s", dir);
    CHECK(q3w_session_save(session, path));
    snprintf(other, sizeof other, "%s/truncated.q3s", dir);
    if (write_truncated(path, other) != 0) goto done;

    const char *names[] = {"huge_layer.q3s", "short.q3s", "fifo.q3s",   "zero.q3s",
                           "truncated.q3s",  "saved.q3s", "missing.q3s"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        if (restore(model, dir, names[i]) != 0) goto done;
    }
    exit_code = 0;

done:
    q3w_session_free(session);
    q3w_string_free(fingerprint);
    q3w_model_free(model);
    q3w_engine_free(engine);
    return exit_code;
}
