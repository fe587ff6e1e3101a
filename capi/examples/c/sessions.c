/*
 * Sessions through the qwen3-wgpu C API: a load cancelled from its progress
 * callback, a prompt fed without blocking, a fork, a session saved and
 * restored, and seeded sampling.
 *
 *   sessions CHECKPOINT_DIR SCRATCH_DIR MAX_NEW_TOKENS PROMPT_ID [PROMPT_ID ...]
 *
 * SCRATCH_DIR receives the converted-weights cache (SCRATCH_DIR/cache) and
 * a saved session (SCRATCH_DIR/session.q3s). Prints one line per part:
 *
 *   cancelled: <status>; phases: ...; cache entries: <n>
 *   loaded; phases: ...; cache entries: <n>
 *   feed: <token> (<fed> of <total> positions)
 *   greedy: <ids>          begin_feed/poll_feed, then try_next_token
 *   fork: <ids>            a fork taken after the prompt, decoded on its own
 *   restored: <ids>        a session saved after the prompt, restored
 *   sampled (seed 7): <ids>    twice, on two sessions: the same tokens
 *
 * The adapter policy comes from QWEN3_WGPU_BACKEND (Metal only when unset;
 * `portable` for Vulkan/DX12).
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* What the progress callback saw: each phase once, in order. */
struct progress {
    uint32_t phases[16];
    size_t n_phases;
    uint32_t cancel_at; /* a Q3W_LOAD_PHASE_* value, or 0: never cancel */
};

/* Called from the load's threads, one call at a time. */
static int32_t on_progress(void *user_data, uint32_t phase, uint64_t bytes_done, uint64_t bytes_total) {
    struct progress *p = user_data;
    (void)bytes_done;
    (void)bytes_total;
    if ((p->n_phases == 0 || p->phases[p->n_phases - 1] != phase) && p->n_phases < 16) {
        p->phases[p->n_phases++] = phase;
    }
    return phase == p->cancel_at ? Q3W_PROGRESS_CANCEL : Q3W_PROGRESS_CONTINUE;
}

static void print_phases(const struct progress *p) {
    printf("phases:");
    for (size_t i = 0; i < p->n_phases; i++) printf(" %s", q3w_load_phase_name(p->phases[i]));
}

/* Files in a directory (0 when it does not exist). */
static int count_entries(const char *path) {
    DIR *dir = opendir(path);
    if (dir == NULL) return 0;
    int n = 0;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        if (strcmp(entry->d_name, ".") != 0 && strcmp(entry->d_name, "..") != 0) n++;
    }
    closedir(dir);
    return n;
}

static void print_tokens(const char *label, const uint32_t *ids, size_t n) {
    printf("%s:", label);
    for (size_t i = 0; i < n; i++) printf(" %u", ids[i]);
    printf("\n");
}

/* The pending token, then blocking steps: `n` tokens in all. */
static q3w_status continue_session(q3w_session *session, uint32_t *out, size_t n) {
    bool has_pending = false;
    q3w_status status = q3w_session_pending(session, &out[0], &has_pending);
    if (status != Q3W_OK) return status;
    if (!has_pending) return Q3W_NO_PENDING_TOKEN;
    for (size_t i = 1; i < n; i++) {
        status = q3w_session_next_token(session, &out[i]);
        if (status != Q3W_OK) return status;
    }
    return Q3W_OK;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s CHECKPOINT_DIR SCRATCH_DIR MAX_NEW_TOKENS PROMPT_ID...\n", argv[0]);
        return 2;
    }
    int exit_code = 1;
    const char *checkpoint = argv[1];
    size_t max_new = strtoul(argv[3], NULL, 10);
    if (max_new == 0) max_new = 1;
    size_t n_prompt = (size_t)(argc - 4);
    uint32_t *prompt = malloc(n_prompt * sizeof *prompt);
    for (size_t i = 0; i < n_prompt; i++) prompt[i] = (uint32_t)strtoul(argv[4 + i], NULL, 10);
    uint32_t *tokens = malloc(max_new * sizeof *tokens);
    char cache_dir[4096], save_path[4096];
    snprintf(cache_dir, sizeof cache_dir, "%s/cache", argv[2]);
    snprintf(save_path, sizeof save_path, "%s/session.q3s", argv[2]);

    q3w_engine *engine = NULL;
    q3w_model *model = NULL;
    q3w_session *session = NULL, *base = NULL, *fork = NULL, *restored = NULL;
    q3w_session *sampled[2] = {NULL, NULL};

    CHECK(q3w_engine_new(NULL, &engine));

    /* A load cancelled by its progress callback once conversion starts:
     * Q3W_CANCELLED, and nothing is left in the cache directory. */
    struct progress progress = {.n_phases = 0, .cancel_at = Q3W_LOAD_PHASE_CONVERTING};
    q3w_load_options load_options;
    CHECK(q3w_load_options_init(&load_options, sizeof load_options));
    load_options.cache_policy = Q3W_CACHE_DIR;
    load_options.cache_dir = cache_dir;
    load_options.progress = on_progress;
    load_options.progress_user_data = &progress;
    q3w_status cancelled = q3w_model_load(engine, checkpoint, &load_options, &model);
    printf("cancelled: %s; ", q3w_status_name(cancelled));
    print_phases(&progress);
    printf("; cache entries: %d\n", count_entries(cache_dir));
    if (cancelled != Q3W_CANCELLED || model != NULL) goto done;

    /* The same load, not cancelled: converted and cached. */
    progress.n_phases = 0;
    progress.cancel_at = 0;
    CHECK(q3w_model_load(engine, checkpoint, &load_options, &model));
    printf("loaded; ");
    print_phases(&progress);
    printf("; cache entries: %d\n", count_entries(cache_dir));

    q3w_session_options session_options;
    CHECK(q3w_session_options_init(&session_options, sizeof session_options));
    session_options.capacity = n_prompt + max_new;

    /* The prompt fed without blocking (a frame loop would render between
     * polls), then tokens as they arrive. */
    CHECK(q3w_session_new(model, &session_options, &session));
    CHECK(q3w_session_begin_feed(session, prompt, n_prompt));
    bool ready = false;
    size_t fed = 0, total = 0, polls = 0;
    uint32_t token = 0;
    while (!ready) {
        CHECK(q3w_session_poll_feed(session, &token, &ready, &fed, &total));
        polls++;
    }
    printf("feed: %u (%zu of %zu positions)\n", token, fed, total);
    fprintf(stderr, "feed: ready after %zu polls\n", polls);
    size_t n = 0;
    tokens[n++] = token;
    while (n < max_new) {
        CHECK(q3w_session_try_next_token(session, &token, &ready));
        if (ready) tokens[n++] = token;
    }
    print_tokens("greedy", tokens, n);

    /* One prompt fed once, then a fork and a saved copy of it. */
    CHECK(q3w_session_new(model, &session_options, &base));
    CHECK(q3w_session_feed(base, prompt, n_prompt, &token));
    CHECK(q3w_session_fork(base, 0, &fork));
    CHECK(q3w_session_save(base, save_path));
    /* The original goes on by itself; the fork is unaffected. */
    for (size_t i = 1; i < max_new; i++) CHECK(q3w_session_next_token(base, &token));
    CHECK(continue_session(fork, tokens, max_new));
    print_tokens("fork", tokens, max_new);
    CHECK(q3w_model_restore_session(model, save_path, 0, &restored));
    CHECK(continue_session(restored, tokens, max_new));
    print_tokens("restored", tokens, max_new);

    /* Seeded sampling: two sessions, the same seed, the same tokens. */
    q3w_sampling_params params;
    CHECK(q3w_sampling_params_init(&params, sizeof params));
    params.temperature = 0.8f;
    params.top_k = 40;
    params.top_p = 0.95f;
    params.seed = 7;
    for (int run = 0; run < 2; run++) {
        CHECK(q3w_session_new(model, &session_options, &sampled[run]));
        CHECK(q3w_session_set_sampling(sampled[run], &params));
        CHECK(q3w_session_feed(sampled[run], prompt, n_prompt, &token));
        CHECK(continue_session(sampled[run], tokens, max_new));
        print_tokens("sampled (seed 7)", tokens, max_new);
    }
    exit_code = 0;

done:
    q3w_session_free(sampled[0]);
    q3w_session_free(sampled[1]);
    q3w_session_free(restored);
    q3w_session_free(fork);
    q3w_session_free(base);
    q3w_session_free(session);
    q3w_model_free(model);
    q3w_engine_free(engine);
    free(tokens);
    free(prompt);
    return exit_code;
}
