/*
 * Batched decoding and log-probabilities through the qwen3-wgpu C API.
 *
 *   batch CHECKPOINT_DIR MAX_NEW_TOKENS PROMPT PROMPT [PROMPT]
 *
 * Each PROMPT is comma-separated token ids (`851,720,591`); two or three
 * of them. Each prompt's conversation is decoded twice: in a session of
 * its own, and in a batch that steps all of them together (blocking steps
 * for the first half, then a non-blocking loop as a frame loop would run
 * it). The program checks that the two agree and prints:
 *
 *   free slots: <n> of <slots>
 *   alone <i>: <ids>        each conversation in its own session
 *   batch <i>: <ids>        the same conversation in the batch
 *   batch: same tokens as alone
 *   logprobs: <n> of <token> (top: <ids>)   after one greedy step
 *   logprobs: finite, sorted, <= 0, the chosen token first
 *   logprobs into 2 entries: 2 written of <n>
 *   batch step of a session reporting logprobs: invalid_argument
 *
 * The adapter policy comes from QWEN3_WGPU_BACKEND (Metal only when unset;
 * `portable` for Vulkan/DX12).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

#define FAIL(...)                                                                     \
    do {                                                                              \
        fprintf(stderr, __VA_ARGS__);                                                 \
        fprintf(stderr, "\n");                                                        \
        goto done;                                                                    \
    } while (0)

#define MAX_SESSIONS 3

/* Parses comma-separated ids into a new array; returns its length. */
static size_t parse_ids(const char *text, uint32_t **out) {
    size_t n = 1;
    for (const char *c = text; *c; c++) n += *c == ',';
    uint32_t *ids = malloc(n * sizeof *ids);
    const char *at = text;
    for (size_t i = 0; i < n; i++) {
        char *end = NULL;
        ids[i] = (uint32_t)strtoul(at, &end, 10);
        at = *end == ',' ? end + 1 : end;
    }
    *out = ids;
    return n;
}

static void print_tokens(const char *label, size_t index, const uint32_t *ids, size_t n) {
    printf("%s %zu:", label, index);
    for (size_t i = 0; i < n; i++) printf(" %u", ids[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    if (argc < 5 || argc > 4 + MAX_SESSIONS) {
        fprintf(stderr, "usage: %s CHECKPOINT_DIR MAX_NEW_TOKENS PROMPT PROMPT [PROMPT]\n", argv[0]);
        return 2;
    }
    int exit_code = 1;
    size_t max_new = strtoul(argv[2], NULL, 10);
    if (max_new < 2) max_new = 2;
    size_t n_sessions = (size_t)(argc - 3);
    uint32_t *prompts[MAX_SESSIONS] = {NULL, NULL, NULL};
    size_t prompt_len[MAX_SESSIONS] = {0, 0, 0};
    uint32_t *alone[MAX_SESSIONS] = {NULL, NULL, NULL};
    uint32_t *batched[MAX_SESSIONS] = {NULL, NULL, NULL};
    for (size_t i = 0; i < n_sessions; i++) {
        prompt_len[i] = parse_ids(argv[3 + i], &prompts[i]);
        alone[i] = malloc(max_new * sizeof(uint32_t));
        batched[i] = malloc(max_new * sizeof(uint32_t));
    }

    q3w_engine *engine = NULL;
    q3w_model *model = NULL;
    q3w_batch *batch = NULL;
    q3w_session *own[MAX_SESSIONS] = {NULL, NULL, NULL};
    q3w_session *members[MAX_SESSIONS] = {NULL, NULL, NULL};
    q3w_session *reporting = NULL;

    CHECK(q3w_engine_new(NULL, &engine));
    q3w_load_options load_options;
    CHECK(q3w_load_options_init(&load_options, sizeof load_options));
    load_options.cache_policy = Q3W_CACHE_DISABLED;
    CHECK(q3w_model_load(engine, argv[1], &load_options, &model));

    /* Each conversation in a session of its own. */
    for (size_t i = 0; i < n_sessions; i++) {
        CHECK(q3w_session_new(model, NULL, &own[i]));
        CHECK(q3w_session_feed(own[i], prompts[i], prompt_len[i], &alone[i][0]));
        for (size_t t = 1; t < max_new; t++) CHECK(q3w_session_next_token(own[i], &alone[i][t]));
    }

    /* The same conversations in one batch: a session per slot. */
    q3w_batch_options batch_options;
    CHECK(q3w_batch_options_init(&batch_options, sizeof batch_options));
    batch_options.slots = n_sessions;
    batch_options.capacity_per_slot = 256;
    CHECK(q3w_batch_new(model, &batch_options, &batch));
    for (size_t i = 0; i < n_sessions; i++) {
        CHECK(q3w_batch_session(batch, &members[i]));
        CHECK(q3w_session_feed(members[i], prompts[i], prompt_len[i], &batched[i][0]));
    }
    size_t slots = 0, free_slots = 0;
    CHECK(q3w_batch_slots(batch, &slots));
    CHECK(q3w_batch_free_slots(batch, &free_slots));
    printf("free slots: %zu of %zu\n", free_slots, slots);

    /* Blocking steps for the first half: one token for each session. */
    uint32_t step_tokens[MAX_SESSIONS];
    size_t t = 1;
    for (; t < max_new / 2; t++) {
        CHECK(q3w_batch_step(batch, members, n_sessions, step_tokens));
        for (size_t i = 0; i < n_sessions; i++) batched[i][t] = step_tokens[i];
    }
    /* Then as a frame loop: poll once a frame, never waiting. */
    size_t polls = 0;
    while (t < max_new) {
        bool ready = false;
        CHECK(q3w_batch_try_step(batch, members, n_sessions, step_tokens, &ready));
        polls++;
        if (!ready) {
            /* A frame would render here; the tokens come by a later one. */
            struct timespec frame = {0, 200000};
            nanosleep(&frame, NULL);
            continue;
        }
        for (size_t i = 0; i < n_sessions; i++) batched[i][t] = step_tokens[i];
        t++;
    }
    fprintf(stderr, "try_step: %zu polls for %zu steps\n", polls, max_new - max_new / 2);
    for (size_t i = 0; i < n_sessions; i++) print_tokens("alone", i, alone[i], max_new);
    for (size_t i = 0; i < n_sessions; i++) print_tokens("batch", i, batched[i], max_new);
    for (size_t i = 0; i < n_sessions; i++) {
        if (memcmp(alone[i], batched[i], max_new * sizeof(uint32_t)) != 0) {
            FAIL("batch session %zu differs from its session alone", i);
        }
    }
    printf("batch: same tokens as alone\n");

    /* Log-probabilities of a greedy step: 5 entries each. */
    CHECK(q3w_session_new(model, NULL, &reporting));
    CHECK(q3w_session_set_logprobs(reporting, 5));
    uint32_t token = 0;
    CHECK(q3w_session_feed(reporting, prompts[0], prompt_len[0], &token));
    CHECK(q3w_session_next_token(reporting, &token));
    q3w_logprob chosen = {0, 0.0f};
    q3w_logprob top[Q3W_MAX_LOGPROBS];
    size_t n_top = 0;
    bool available = false;
    CHECK(q3w_session_last_logprobs(reporting, &chosen, top, Q3W_MAX_LOGPROBS, &n_top, &available));
    if (!available || n_top != 5) FAIL("logprobs: available %d, %zu entries", available, n_top);
    printf("logprobs: %zu of %u (top:", n_top, chosen.token);
    for (size_t i = 0; i < n_top; i++) printf(" %u", top[i].token);
    printf(")\n");
    for (size_t i = 0; i < n_top; i++) {
        if (!isfinite(top[i].logprob) || top[i].logprob > 0.0f) FAIL("entry %zu: %g", i, top[i].logprob);
        if (i > 0 && top[i].logprob > top[i - 1].logprob) FAIL("entry %zu is above entry %zu", i, i - 1);
    }
    if (chosen.token != token || top[0].token != token || chosen.logprob != top[0].logprob) {
        FAIL("greedy chose %u (%g); the top entry is %u (%g)", chosen.token, chosen.logprob, top[0].token,
             top[0].logprob);
    }
    printf("logprobs: finite, sorted, <= 0, the chosen token first\n");

    /* A smaller array: only its capacity is written; the count says how
     * many there are. */
    q3w_logprob few[3] = {{7, 1.0f}, {7, 1.0f}, {7, 1.0f}};
    CHECK(q3w_session_last_logprobs(reporting, &chosen, few, 2, &n_top, &available));
    if (few[0].token != top[0].token || few[1].token != top[1].token || few[2].token != 7 ||
        few[2].logprob != 1.0f) {
        FAIL("logprobs into 2 entries wrote past them or other entries");
    }
    printf("logprobs into 2 entries: 2 written of %zu\n", n_top);

    /* Batch steps compute no log-probabilities: refused. */
    CHECK(q3w_session_set_logprobs(members[0], 3));
    q3w_status refused = q3w_batch_step(batch, members, n_sessions, step_tokens);
    printf("batch step of a session reporting logprobs: %s\n", q3w_status_name(refused));
    if (refused != Q3W_INVALID_ARGUMENT) goto done;
    exit_code = 0;

done:
    q3w_session_free(reporting);
    for (size_t i = 0; i < MAX_SESSIONS; i++) {
        q3w_session_free(members[i]);
        q3w_session_free(own[i]);
        free(prompts[i]);
        free(alone[i]);
        free(batched[i]);
    }
    q3w_batch_free(batch);
    q3w_model_free(model);
    q3w_engine_free(engine);
    return exit_code;
}
