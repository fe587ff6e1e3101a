/*
 * Greedy decoding through the qwen3-wgpu C API.
 *
 *   greedy CHECKPOINT_DIR TOKENIZER_DIR MAX_NEW_TOKENS [PROMPT_ID ...]
 *
 * The prompt is the given token ids, or else one user turn rendered by the
 * chat template of TOKENIZER_DIR (thinking off). Prints the prompt ids, the
 * generated text as it streams, and the generated ids; stops at an
 * end-of-text id. The adapter policy comes from QWEN3_WGPU_BACKEND (Metal
 * only when unset; `portable` for Vulkan/DX12).
 */
#include <stdio.h>
#include <stdlib.h>

#include "qwen3_wgpu.h"

/* On failure: print the status's name and the thread's last message. */
#define CHECK(call)                                                                   \
    do {                                                                              \
        q3w_status status_ = (call);                                                  \
        if (status_ != Q3W_OK) {                                                      \
            fprintf(stderr, "error [%s]: %s\n", q3w_status_name(status_),             \
                    q3w_last_error_message());                                        \
            goto done;                                                                \
        }                                                                             \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s CHECKPOINT_DIR TOKENIZER_DIR MAX_NEW_TOKENS [PROMPT_ID ...]\n", argv[0]);
        return 2;
    }
    int exit_code = 1;
    size_t max_new = strtoul(argv[3], NULL, 10);
    q3w_engine *engine = NULL;
    q3w_model *model = NULL;
    q3w_session *session = NULL;
    q3w_tokenizer *tokenizer = NULL;
    q3w_text_stream *stream = NULL;
    q3w_chat_template *chat = NULL;
    uint32_t *chat_ids = NULL; /* from the library: q3w_tokens_free */
    uint32_t *arg_ids = NULL;  /* ours: free */
    uint32_t *generated = malloc((max_new ? max_new : 1) * sizeof *generated);
    const uint32_t *prompt = NULL;
    size_t n_prompt = 0, n_generated = 0;
    char *description = NULL;

    q3w_engine_options engine_options;
    CHECK(q3w_engine_options_init(&engine_options, sizeof engine_options));
    CHECK(q3w_engine_new(&engine_options, &engine));
    CHECK(q3w_engine_describe(engine, &description, NULL));
    fprintf(stderr, "adapter: %s\n", description);

    q3w_load_options load_options;
    CHECK(q3w_load_options_init(&load_options, sizeof load_options)); /* the platform's cache directory */
    CHECK(q3w_model_load(engine, argv[1], &load_options, &model));
    CHECK(q3w_tokenizer_from_checkpoint(argv[2], &tokenizer));

    if (argc > 4) {
        n_prompt = (size_t)(argc - 4);
        arg_ids = malloc(n_prompt * sizeof *arg_ids);
        for (size_t i = 0; i < n_prompt; i++) arg_ids[i] = (uint32_t)strtoul(argv[4 + i], NULL, 10);
        prompt = arg_ids;
    } else {
        q3w_chat_message turn = {.role = "user", .content = "The capital of France is", .extra_json = NULL};
        q3w_chat_options chat_options;
        CHECK(q3w_chat_options_init(&chat_options, sizeof chat_options));
        chat_options.enable_thinking = 0;
        CHECK(q3w_chat_template_from_checkpoint(argv[2], &chat));
        CHECK(q3w_chat_template_encode(chat, tokenizer, &turn, 1, &chat_options, &chat_ids, &n_prompt));
        prompt = chat_ids;
    }
    printf("prompt:");
    for (size_t i = 0; i < n_prompt; i++) printf(" %u", prompt[i]);
    printf("\ntext: ");

    q3w_session_options session_options;
    CHECK(q3w_session_options_init(&session_options, sizeof session_options));
    session_options.capacity = n_prompt + max_new;
    CHECK(q3w_session_new(model, &session_options, &session));
    CHECK(q3w_text_stream_new(tokenizer, &stream));

    uint32_t token;
    const char *piece;
    size_t piece_len;
    if (max_new > 0) CHECK(q3w_session_feed(session, prompt, n_prompt, &token));
    while (n_generated < max_new) {
        generated[n_generated++] = token;
        CHECK(q3w_text_stream_push(stream, token, &piece, &piece_len));
        fwrite(piece, 1, piece_len, stdout);
        fflush(stdout);
        bool end_of_text;
        CHECK(q3w_model_is_end_of_text(model, token, &end_of_text));
        if (end_of_text || n_generated == max_new) break;
        CHECK(q3w_session_next_token(session, &token));
    }
    CHECK(q3w_text_stream_finish(stream, &piece, &piece_len));
    fwrite(piece, 1, piece_len, stdout);
    printf("\ntokens:");
    for (size_t i = 0; i < n_generated; i++) printf(" %u", generated[i]);
    printf("\n");
    exit_code = 0;

done:
    q3w_string_free(description);
    q3w_tokens_free(chat_ids);
    free(arg_ids);
    free(generated);
    q3w_chat_template_free(chat);
    q3w_text_stream_free(stream);
    q3w_tokenizer_free(tokenizer);
    q3w_session_free(session);
    q3w_model_free(model);
    q3w_engine_free(engine);
    return exit_code;
}
