/*
 * A host that loads the library at run time, as an engine plugin would:
 * dlopen, then every function through dlsym (the header supplies only the
 * types; nothing is linked).
 *
 *   plugin_host LIBRARY CHECKPOINT_DIR MAX_NEW_TOKENS PROMPT_ID...
 *
 * Checks error paths from C (a bad policy value, a NULL handle), then
 * loads with a progress callback, feeds the prompt without blocking,
 * decodes greedily and prints "tokens: ...".
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qwen3_wgpu.h"

/* `p_NAME`: the library's NAME, typed from the header's declaration. */
#define RESOLVE(name)                                                            \
    __typeof__(&name) p_##name = (__typeof__(&name))dlsym(library, #name);      \
    if (p_##name == NULL) {                                                      \
        fprintf(stderr, "missing symbol %s: %s\n", #name, dlerror());            \
        return 1;                                                                \
    }

#define EXPECT(cond)                                                             \
    if (!(cond)) {                                                               \
        fprintf(stderr, "%s:%d: expected %s (last message: %s)\n", __FILE__,     \
                __LINE__, #cond, p_q3w_last_error_message());                    \
        return 1;                                                                \
    }

/* Counts the load's progress reports. */
static int32_t count_progress(void *user_data, uint32_t phase, uint64_t done, uint64_t total) {
    (void)phase;
    (void)done;
    (void)total;
    ++*(unsigned long *)user_data;
    return Q3W_PROGRESS_CONTINUE;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s LIBRARY CHECKPOINT_DIR MAX_NEW_TOKENS PROMPT_ID...\n", argv[0]);
        return 2;
    }
    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    RESOLVE(q3w_last_error_message);
    RESOLVE(q3w_status_name);
    RESOLVE(q3w_engine_options_init);
    RESOLVE(q3w_engine_new);
    RESOLVE(q3w_engine_free);
    RESOLVE(q3w_model_load);
    RESOLVE(q3w_model_free);
    RESOLVE(q3w_session_new);
    RESOLVE(q3w_session_free);
    RESOLVE(q3w_session_begin_feed);
    RESOLVE(q3w_session_poll_feed);
    RESOLVE(q3w_session_next_token);
    RESOLVE(q3w_load_options_init);

    size_t max_new = strtoul(argv[3], NULL, 10);
    size_t n_prompt = (size_t)(argc - 4);
    uint32_t *prompt = malloc(n_prompt * sizeof *prompt);
    for (size_t i = 0; i < n_prompt; i++) prompt[i] = (uint32_t)strtoul(argv[4 + i], NULL, 10);

    /* A policy value the header does not define. */
    q3w_engine_options options;
    EXPECT(p_q3w_engine_options_init(&options, sizeof options) == Q3W_OK);
    options.adapter_policy = 7;
    q3w_engine *engine = (q3w_engine *)&options; /* must be reset to NULL */
    EXPECT(p_q3w_engine_new(&options, &engine) == Q3W_INVALID_ARGUMENT);
    EXPECT(engine == NULL);
    EXPECT(strstr(p_q3w_last_error_message(), "adapter_policy") != NULL);
    EXPECT(strcmp(p_q3w_status_name(Q3W_INVALID_ARGUMENT), "invalid_argument") == 0);

    /* A NULL handle. */
    uint32_t token = 0;
    EXPECT(p_q3w_session_next_token(NULL, &token) == Q3W_INVALID_ARGUMENT);
    EXPECT(strcmp(p_q3w_last_error_message(), "invalid argument session: is NULL") == 0);

    /* Greedy decoding on the portable policy. */
    options.adapter_policy = Q3W_ADAPTER_POLICY_PORTABLE;
    EXPECT(p_q3w_engine_new(&options, &engine) == Q3W_OK);
    q3w_model *model = NULL;
    q3w_load_options load_options;
    EXPECT(p_q3w_load_options_init(&load_options, sizeof load_options) == Q3W_OK);
    unsigned long progress_calls = 0;
    load_options.progress = count_progress;
    load_options.progress_user_data = &progress_calls;
    EXPECT(p_q3w_model_load(engine, argv[2], &load_options, &model) == Q3W_OK);
    EXPECT(progress_calls > 0);
    q3w_session *session = NULL;
    EXPECT(p_q3w_session_new(model, NULL, &session) == Q3W_OK);
    printf("tokens:");
    if (max_new > 0) {
        /* The prompt fed without blocking, as a frame loop would. */
        EXPECT(p_q3w_session_begin_feed(session, prompt, n_prompt) == Q3W_OK);
        bool ready = false;
        while (!ready) EXPECT(p_q3w_session_poll_feed(session, &token, &ready, NULL, NULL) == Q3W_OK);
        printf(" %u", token);
        for (size_t i = 1; i < max_new; i++) {
            EXPECT(p_q3w_session_next_token(session, &token) == Q3W_OK);
            printf(" %u", token);
        }
    }
    printf("\n");
    EXPECT(p_q3w_session_free(session) == Q3W_OK);
    EXPECT(p_q3w_model_free(model) == Q3W_OK);
    EXPECT(p_q3w_engine_free(engine) == Q3W_OK);
    free(prompt);
    if (dlclose(library) != 0) {
        fprintf(stderr, "dlclose: %s\n", dlerror());
        return 1;
    }
    return 0;
}
