/*
 * A host constraining a session's output through the C ABI, under the
 * sanitizers.
 *
 *   constrained CHECKPOINT_DIR TOKENIZER_DIR
 *
 * Prints, one per line: the statuses of refused constraints (a regex that
 * does not compile, a schema that is not JSON, a NULL grammar), then the
 * greedy replies to the prompt 1 2 3 under a regular expression, a JSON
 * schema, a Lark grammar and required tool calls (each until
 * q3w_session_constraint_complete), as "<kind>: <text>", and the calls
 * q3w_parse_tool_calls reads out of the last, as "calls: <json>".
 */
#include <stdbool.h>
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

enum { MAX_REPLY = 200 };

static char last_text[4096];
static size_t last_len;

/* Feeds 1 2 3 and takes tokens until the constraint is complete; prints
 * "<kind>: <text>" and keeps the text in last_text. */
static q3w_status reply(q3w_session *session, const q3w_tokenizer *tokenizer, const char *kind) {
    static const uint32_t prompt[] = {1, 2, 3};
    uint32_t ids[MAX_REPLY];
    size_t n = 0;
    bool complete = false;
    char *text = NULL;
    size_t text_len = 0;
    q3w_status status = q3w_session_truncate(session, 0);
    if (status == Q3W_OK) status = q3w_session_feed(session, prompt, 3, &ids[n++]);
    while (status == Q3W_OK && n < MAX_REPLY) {
        status = q3w_session_constraint_complete(session, &complete);
        if (status != Q3W_OK || complete) break;
        status = q3w_session_next_token(session, &ids[n++]);
    }
    if (status == Q3W_OK) status = q3w_tokenizer_decode(tokenizer, ids, n, &text, &text_len);
    if (status == Q3W_OK) {
        printf("%s: %.*s%s\n", kind, (int)text_len, text, complete ? "" : " (incomplete)");
        last_len = text_len < sizeof last_text ? text_len : sizeof last_text;
        memcpy(last_text, text, last_len);
    }
    q3w_string_free(text);
    return status;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CHECKPOINT_DIR TOKENIZER_DIR\n", argv[0]);
        return 2;
    }
    int exit_code = 1;
    q3w_engine *engine = NULL;
    q3w_model *model = NULL;
    q3w_session *session = NULL;
    q3w_tokenizer *tokenizer = NULL;

    CHECK(q3w_engine_new(NULL, &engine));
    q3w_load_options load_options;
    CHECK(q3w_load_options_init(&load_options, sizeof load_options));
    load_options.cache_policy = Q3W_CACHE_DISABLED;
    CHECK(q3w_model_load(engine, argv[1], &load_options, &model));
    CHECK(q3w_tokenizer_from_checkpoint(argv[2], &tokenizer));
    CHECK(q3w_session_new(model, NULL, &session));

    printf("bad regex: %s\n", q3w_status_name(q3w_session_set_regex(session, tokenizer, "(unclosed")));
    printf("bad schema: %s\n", q3w_status_name(q3w_session_set_json_schema(session, tokenizer, "{not json")));
    printf("null grammar: %s\n", q3w_status_name(q3w_session_set_grammar(session, tokenizer, NULL)));

    CHECK(q3w_session_set_regex(session, tokenizer, "(yes|no), [0-9]{2}!"));
    CHECK(reply(session, tokenizer, "regex"));
    CHECK(q3w_session_set_json_schema(
        session, tokenizer,
        "{\"type\": \"object\", \"properties\": {\"hp\": {\"type\": \"integer\", \"minimum\": 0, "
        "\"maximum\": 99}}, \"required\": [\"hp\"], \"additionalProperties\": false}"));
    CHECK(reply(session, tokenizer, "json_schema"));
    CHECK(q3w_session_set_grammar(session, tokenizer, "start: \"go \" DIR\nDIR: \"north\" | \"south\""));
    CHECK(reply(session, tokenizer, "grammar"));
    static const char *tools =
        "[{\"type\": \"function\", \"function\": {\"name\": \"give\", \"parameters\": {\"type\": "
        "\"object\", \"properties\": {\"gold\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 9}}, "
        "\"required\": [\"gold\"], \"additionalProperties\": false}}}]";
    printf("bad tools: %s\n", q3w_status_name(q3w_session_set_tools(session, tokenizer, "[{}]", "required", 1)));
    printf("bad max_calls: %s\n", q3w_status_name(q3w_session_set_tools(session, tokenizer, tools, "required", 0)));
    CHECK(q3w_session_set_tools(session, tokenizer, tools, "required", 1));
    CHECK(reply(session, tokenizer, "tools"));
    char *calls = NULL;
    CHECK(q3w_parse_tool_calls(last_text, last_len, &calls, NULL));
    printf("calls: %s\n", calls);
    q3w_string_free(calls);
    CHECK(q3w_session_clear_constraint(session));
    bool complete = true;
    CHECK(q3w_session_constraint_complete(session, &complete));
    printf("cleared: %s\n", complete ? "complete" : "free");
    exit_code = 0;
done:
    q3w_session_free(session);
    q3w_tokenizer_free(tokenizer);
    q3w_model_free(model);
    q3w_engine_free(engine);
    return exit_code;
}
