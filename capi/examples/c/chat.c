/*
 * One chat turn with an instruct checkpoint through the qwen3-wgpu C API
 * (the C API guide's example): loaded with a progress display, sampled as the
 * checkpoint's generation_config.json says with a fixed seed, the prompt
 * fed and the reply taken without ever blocking on the GPU.
 *
 *   chat CHECKPOINT_DIR TEXT        e.g. ./chat ./qwen3-0.6b "Can you fix my sword?"
 */
#include <stdio.h>

#include "qwen3_wgpu.h"

#define TRY(call)                                                                           \
    do {                                                                                    \
        q3w_status s_ = (call);                                                             \
        if (s_ != Q3W_OK) {                                                                 \
            fprintf(stderr, "error [%s]: %s\n", q3w_status_name(s_), q3w_last_error_message()); \
            goto out;                                                                       \
        }                                                                                   \
    } while (0)

/* Called from the load's threads, one call at a time. */
static int32_t show_progress(void *user_data, uint32_t phase, uint64_t done, uint64_t total) {
    (void)user_data;
    fprintf(stderr, "\r%-13s %3.0f%%", q3w_load_phase_name(phase), total ? 100.0 * done / total : 100.0);
    return Q3W_PROGRESS_CONTINUE; /* anything else cancels: Q3W_CANCELLED, no cache file left */
}

int main(int argc, char **argv) {
    if (argc != 3) return fprintf(stderr, "usage: %s CHECKPOINT_DIR TEXT\n", argv[0]), 2;
    int exit_code = 1;
    q3w_engine *engine = NULL;
    q3w_model *model = NULL;
    q3w_tokenizer *tokenizer = NULL;
    q3w_chat_template *chat = NULL;
    q3w_session *session = NULL;
    q3w_text_stream *stream = NULL;
    uint32_t *prompt = NULL;
    size_t n_prompt = 0;

    TRY(q3w_engine_new(NULL, &engine)); /* Metal; QWEN3_WGPU_BACKEND=portable elsewhere */
    q3w_load_options load;
    TRY(q3w_load_options_init(&load, sizeof load));
    load.progress = show_progress;
    TRY(q3w_model_load(engine, argv[1], &load, &model));
    fprintf(stderr, "\n");
    TRY(q3w_tokenizer_from_checkpoint(argv[1], &tokenizer));
    TRY(q3w_chat_template_from_checkpoint(argv[1], &chat));

    q3w_chat_message turn = {.role = "user", .content = argv[2], .extra_json = NULL};
    q3w_chat_options chat_options;
    TRY(q3w_chat_options_init(&chat_options, sizeof chat_options));
    chat_options.enable_thinking = 0;
    TRY(q3w_chat_template_encode(chat, tokenizer, &turn, 1, &chat_options, &prompt, &n_prompt));
    uint32_t im_end = 0;
    bool found = false;
    TRY(q3w_tokenizer_token_id(tokenizer, "<|im_end|>", &im_end, &found));

    q3w_sampling_params sampling;
    TRY(q3w_sampling_params_init(&sampling, sizeof sampling));
    TRY(q3w_sampling_params_from_generation_config(argv[1], &sampling));
    sampling.seed = 42; /* the same seed gives the same reply */
    TRY(q3w_session_new(model, NULL, &session));
    TRY(q3w_session_set_sampling(session, &sampling));
    TRY(q3w_text_stream_new(tokenizer, &stream));

    /* A game makes one of these non-blocking calls per frame and renders
     * in between; here the frames are empty. */
    uint32_t token = 0;
    bool ready = false;
    const char *piece;
    size_t len;
    TRY(q3w_session_begin_feed(session, prompt, n_prompt));
    while (!ready) TRY(q3w_session_poll_feed(session, &token, &ready, NULL, NULL));
    for (int n = 1;; n++) {
        bool end = found && token == im_end;
        if (!end) TRY(q3w_model_is_end_of_text(model, token, &end));
        if (end) break;
        TRY(q3w_text_stream_push(stream, token, &piece, &len)); /* borrowed until the next call */
        fwrite(piece, 1, len, stdout);
        fflush(stdout);
        if (n == 256) break;
        for (ready = false; !ready;) TRY(q3w_session_try_next_token(session, &token, &ready));
    }
    TRY(q3w_text_stream_finish(stream, &piece, &len)); /* a character cut short at the end */
    fwrite(piece, 1, len, stdout);
    printf("\n");
    exit_code = 0;
out:
    q3w_tokens_free(prompt);
    q3w_text_stream_free(stream);
    q3w_session_free(session);
    q3w_chat_template_free(chat);
    q3w_tokenizer_free(tokenizer);
    q3w_model_free(model);
    q3w_engine_free(engine);
    return exit_code;
}
