// Greedy decoding through the qwen3-wgpu C API from C++, with RAII handles
// and a frame loop that never blocks on the GPU (the prompt through
// q3w_session_begin_feed/poll_feed, then q3w_session_try_next_token).
//
//   greedy_cpp CHECKPOINT_DIR TOKENIZER_DIR MAX_NEW_TOKENS PROMPT_ID [PROMPT_ID ...]
//
// Prints the same lines as examples/c/greedy.c given prompt ids.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "qwen3_wgpu.h"

namespace q3w {

// A failed call: the status and the thread's message, taken at once.
struct Error : std::runtime_error {
    q3w_status status;
    explicit Error(q3w_status s)
        : std::runtime_error(std::string("[") + q3w_status_name(s) + "] " + q3w_last_error_message()), status(s) {}
};

inline void check(q3w_status s) {
    if (s != Q3W_OK) throw Error(s);
}

// One owning pointer type per handle, each with its free function.
template <typename T, q3w_status (*Free)(T *)>
struct Deleter {
    void operator()(T *p) const noexcept { Free(p); }
};
template <typename T, q3w_status (*Free)(T *)>
using Handle = std::unique_ptr<T, Deleter<T, Free>>;

using Engine = Handle<q3w_engine, q3w_engine_free>;
using Model = Handle<q3w_model, q3w_model_free>;
using Session = Handle<q3w_session, q3w_session_free>;
using Tokenizer = Handle<q3w_tokenizer, q3w_tokenizer_free>;
using TextStream = Handle<q3w_text_stream, q3w_text_stream_free>;

// Creates a handle through a `q3w_*_new(..., T **out)` style call.
template <typename H, typename F>
H make(F &&create) {
    typename H::pointer raw = nullptr;
    check(create(&raw));
    return H(raw);
}

}  // namespace q3w

int main(int argc, char **argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s CHECKPOINT_DIR TOKENIZER_DIR MAX_NEW_TOKENS PROMPT_ID...\n", argv[0]);
        return 2;
    }
    try {
        const size_t max_new = std::strtoul(argv[3], nullptr, 10);
        std::vector<uint32_t> prompt;
        for (int i = 4; i < argc; i++) prompt.push_back(static_cast<uint32_t>(std::strtoul(argv[i], nullptr, 10)));

        auto engine = q3w::make<q3w::Engine>([](q3w_engine **out) { return q3w_engine_new(nullptr, out); });
        auto model = q3w::make<q3w::Model>(
            [&](q3w_model **out) { return q3w_model_load(engine.get(), argv[1], nullptr, out); });
        engine.reset();  // the model keeps what it needs of the engine
        auto tokenizer = q3w::make<q3w::Tokenizer>(
            [&](q3w_tokenizer **out) { return q3w_tokenizer_from_checkpoint(argv[2], out); });
        q3w_session_options options;
        q3w::check(q3w_session_options_init(&options, sizeof options));
        options.capacity = prompt.size() + max_new;
        auto session = q3w::make<q3w::Session>(
            [&](q3w_session **out) { return q3w_session_new(model.get(), &options, out); });
        auto stream = q3w::make<q3w::TextStream>(
            [&](q3w_text_stream **out) { return q3w_text_stream_new(tokenizer.get(), out); });

        std::printf("prompt:");
        for (uint32_t id : prompt) std::printf(" %u", id);
        std::printf("\ntext: ");

        std::vector<uint32_t> generated;
        const char *piece = nullptr;
        size_t piece_len = 0;
        auto show = [&](uint32_t token) {
            q3w::check(q3w_text_stream_push(stream.get(), token, &piece, &piece_len));
            std::fwrite(piece, 1, piece_len, stdout);
            std::fflush(stdout);
        };
        uint32_t token = 0;
        size_t frames = 0;
        if (max_new > 0) {
            // The prompt, fed without blocking: one poll per "frame".
            q3w::check(q3w_session_begin_feed(session.get(), prompt.data(), prompt.size()));
            for (bool ready = false; !ready; frames++) {
                q3w::check(q3w_session_poll_feed(session.get(), &token, &ready, nullptr, nullptr));
                if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            generated.push_back(token);
            show(token);
        }
        bool end = false;
        while (generated.size() < max_new && !end) {
            q3w::check(q3w_model_is_end_of_text(model.get(), token, &end));
            if (end) break;
            // One "frame": take the next token if it has arrived, else carry
            // on rendering (here: nothing) and ask again next frame.
            bool ready = false;
            q3w::check(q3w_session_try_next_token(session.get(), &token, &ready));
            frames++;
            if (ready) {
                generated.push_back(token);
                show(token);
            } else {
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
        }
        q3w::check(q3w_text_stream_finish(stream.get(), &piece, &piece_len));
        std::fwrite(piece, 1, piece_len, stdout);
        std::printf("\ntokens:");
        for (uint32_t id : generated) std::printf(" %u", id);
        std::printf("\n");
        std::fprintf(stderr, "%zu tokens in %zu frames\n", generated.size(), frames);
        return 0;
    } catch (const q3w::Error &e) {
        std::fprintf(stderr, "error %s\n", e.what());
        return 1;
    }
}
