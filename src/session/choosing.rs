//! How a session chooses its tokens: sampling parameters, an output
//! constraint and its token mask on the GPU, log-probabilities, and the
//! token-choice launches they rebuild.

use super::*;

impl Session {
    /// Sets how the next tokens are chosen (greedy by default): from the
    /// next token on, every step samples under `params` on the GPU (see
    /// [`SamplingParams`]). Steps already queued ahead are discarded, so
    /// the next token uses the new parameters; the pending token stays.
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
    /// use qwen3_wgpu::SamplingParams;
    /// let mut session = model.session()?;
    /// session.set_sampling(&SamplingParams::default().temperature(0.7).top_p(0.9).seed(42))?;
    /// let first = session.feed(&[785, 6722, 315])?; // sampled
    /// let second = session.next_token()?;
    /// # let _ = (first, second);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: those of [`SamplingParams::validate`] (the session is left
    /// as it was); [`Error::InvalidArgument`] naming `session` while a
    /// [`begin_feed`](Self::begin_feed) is in progress; a GPU failure while
    /// waiting for the discarded steps.
    pub fn set_sampling(&mut self, params: &SamplingParams) -> Result<()> {
        self.settle_batch();
        self.check_no_feed()?;
        params.validate()?;
        self.discard_queued()?;
        self.rebuild_choose(params, self.logprobs)?;
        self.sampling = params.clone();
        self.edits += 1;
        Ok(())
    }

    /// Constrains each reply to what `constraint` allows (`None` lifts
    /// it): a reply is the tokens returned after a [`feed`](Self::feed)
    /// (its last token included) and the [`next_token`](Self::next_token)
    /// or [`try_next_token`](Self::try_next_token) calls that follow; each
    /// step chooses among the tokens the constraint allows only (greedy or
    /// sampled alike). Every feed (and [`truncate`](Self::truncate)) starts
    /// the constraint over for the next reply. Once a reply is a whole
    /// match ([`constraint_complete`](Self::constraint_complete)), only
    /// end-of-text tokens are allowed.
    ///
    /// A constrained session keeps one step in flight (each step's mask
    /// depends on the token before it); steps queued ahead are discarded.
    /// Tokens the constraint forces after a chosen one (a JSON key after
    /// the value before it, the fixed words of a pattern) run through the
    /// model as one prompt batch with the choice after them: the calls
    /// that return them take no step each and wait for nothing (they are
    /// the tokenizer's own spelling of the forced text, but the last,
    /// which the text after could change). A session reporting
    /// log-probabilities ([`set_logprobs`](Self::set_logprobs)) steps
    /// every token, and so does a [`Batch`]'s session (its forced tokens
    /// are rows of the batch's steps; its tokens alone are those it gets
    /// in the batch).
    /// A pending token stays as it was chosen, and the constraint starts
    /// with the token after it. Session files and forks hold no constraint
    /// (set it again on the restored or forked session).
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model, tokenizer: &qwen3_wgpu::Tokenizer) -> qwen3_wgpu::Result<()> {
    /// use qwen3_wgpu::Constraint;
    /// let mut session = model.session()?;
    /// session.set_constraint(Some(&Constraint::regex(tokenizer, "(yes|no)\\.")?))?;
    /// let mut ids = vec![session.feed(&tokenizer.encode("Is the door open?")?)?];
    /// while !session.constraint_complete() {
    ///     ids.push(session.next_token()?);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] naming the constraint's kind
    /// when its parser fails, or naming `session` while a
    /// [`begin_feed`](Self::begin_feed) is in progress (the session is left
    /// as it was); a GPU failure while waiting for the discarded steps.
    pub fn set_constraint(&mut self, constraint: Option<&crate::Constraint>) -> Result<()> {
        self.settle_batch();
        self.check_no_feed()?;
        let mut state = constraint.map(crate::Constraint::start).transpose()?;
        self.discard_queued()?;
        if let Some(state) = &mut state {
            state.set_fast_forward(self.fast_forward_below());
        }
        let was_constrained = self.constraint.is_some();
        self.constraint = state;
        self.forced.clear();
        self.write_token_mask();
        if was_constrained != self.constraint.is_some() {
            let params = self.sampling.clone();
            self.rebuild_choose(&params, self.logprobs)?;
        }
        self.edits += 1;
        Ok(())
    }

    /// True when the session's constraint is complete: the tokens returned
    /// since it was set form a whole match, and only end-of-text may
    /// follow. False without a constraint.
    pub fn constraint_complete(&self) -> bool {
        // The constraint is past the forced tokens not yet returned.
        self.forced.is_empty() && self.constraint.as_ref().is_some_and(|c| c.is_complete())
    }

    /// Advances the constraint past `token`, a token just returned, and
    /// puts the next mask on the GPU (queued before the next step).
    pub(super) fn advance_constraint(&mut self, token: u32) -> Result<()> {
        let consumed = self.consume_constraint(token);
        self.after_constraint_consumed(consumed)
    }

    /// The host half of [`Self::advance_constraint`]: the constraint past
    /// `token` (its mask computed: up to milliseconds inside a free
    /// string, so a batch runs its members' in parallel); whether it was
    /// dormant and whether `token` woke it (`None` without a constraint).
    pub(super) fn consume_constraint(&mut self, token: u32) -> Result<Option<(bool, bool)>> {
        let Some(c) = &mut self.constraint else { return Ok(None) };
        let was_dormant = c.is_dormant();
        Ok(Some((was_dormant, c.consume(token)?)))
    }

    /// The GPU half of [`Self::advance_constraint`], after
    /// [`Self::consume_constraint`].
    pub(super) fn after_constraint_consumed(&mut self, consumed: Result<Option<(bool, bool)>>) -> Result<()> {
        let Some((was_dormant, woke)) = consumed? else { return Ok(()) };
        if woke {
            // The steps queued past the trigger chose freely: choose again.
            self.discard_queued()?;
        }
        if !was_dormant || woke {
            self.write_token_mask();
        }
        self.take_forced_from_constraint();
        Ok(())
    }

    /// Starts the constraint over (a new reply follows) and puts its first
    /// mask on the GPU, queued before the steps that follow.
    pub(super) fn restart_constraint(&mut self) -> Result<()> {
        self.forced.clear();
        // A constraint at its start is on the GPU already (a truncate and
        // the feed after it restart it once, not twice).
        if let Some(c) = self.constraint.as_mut().filter(|c| !c.is_fresh()) {
            self.constraint = Some(c.restarted()?);
            self.write_token_mask();
        }
        Ok(())
    }

    /// Writes the constraint's mask of the tokens allowed next.
    pub(super) fn write_token_mask(&self) {
        if let Some(c) = &self.constraint {
            let words = c.mask_words(self.model.config.vocab_size);
            self.model.gpu.queue.write_buffer(&self.bufs.token_mask, 0, bytemuck::cast_slice(&words));
        }
    }

    /// The lookahead in effect: 1 while a constraint is awake (each step's
    /// mask waits for the token before it).
    pub(super) fn effective_lookahead(&self) -> usize {
        if self.constraint_awake() {
            1
        } else {
            self.lookahead
        }
    }

    /// True while the session has a constraint (its state may be on
    /// another thread, computing the next mask).
    pub(super) fn has_constraint(&self) -> bool {
        self.constraint.is_some() || self.choice_on_worker.is_some()
    }

    /// True while a constraint is awake (not waiting for its trigger): a
    /// choice on the session's thread is one of an awake constraint.
    pub(super) fn constraint_awake(&self) -> bool {
        self.choice_on_worker.is_some() || self.constraint.as_ref().is_some_and(|c| !c.is_dormant())
    }

    /// Rebuilds the launches choosing the token (and computing the
    /// log-probabilities of the `logprobs` most likely tokens).
    pub(super) fn rebuild_choose(&mut self, params: &SamplingParams, logprobs: u32) -> Result<()> {
        let masked = self.constraint.is_some();
        let model = &self.model;
        let (choose, bytes) = model.gpu.scoped(
            || {
                Ok(crate::qwen3::choose_launches(
                    &model.gpu,
                    &model.kernels,
                    &model.config,
                    &self.bufs,
                    params,
                    logprobs,
                    masked,
                ))
            },
            |reason| Error::GpuDeviceFailed { reason: format!("setting sampling: {reason}") },
        )?;
        self.forward.choose = choose;
        self.forward.choose_uniform_bytes = bytes;
        self.step_launches = None;
        Ok(())
    }

    /// Computes the log-probabilities of the `n` most likely tokens, and of
    /// the token chosen, with every token from the next one on (0, the
    /// default: off, and no extra launch or readback). They are of the
    /// model's raw distribution, `log_softmax(logits)`, before penalties,
    /// temperature and filters (as mlx-lm returns them), computed on the
    /// GPU inside the step and read back with the token, so steps still
    /// queue ahead. Get them with [`last_logprobs`](Self::last_logprobs).
    /// Steps already queued ahead are discarded (as by
    /// [`set_sampling`](Self::set_sampling)).
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
    /// let mut session = model.session()?;
    /// session.set_logprobs(5)?;
    /// let token = session.feed(&[785, 6722, 315])?;
    /// let lp = session.last_logprobs().expect("on");
    /// assert_eq!(lp.token, token);
    /// for (id, logprob) in &lp.top {
    ///     println!("{id}: {logprob:.3}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] naming `logprobs` above 20
    /// (OpenAI's bound), or naming `session` while a
    /// [`begin_feed`](Self::begin_feed) is in progress (the session is left
    /// as it was); a GPU failure while waiting for the discarded steps.
    pub fn set_logprobs(&mut self, n: u32) -> Result<()> {
        self.settle_batch();
        self.check_no_feed()?;
        if n > MAX_LOGPROBS {
            return Err(Error::invalid_argument(
                "logprobs",
                format!("{n} is more than the {MAX_LOGPROBS} supported"),
            ));
        }
        self.discard_queued()?;
        if n > 0 && self.bufs.logprobs.is_none() {
            let cfg = &self.model.config;
            self.bufs.logprobs =
                Some(crate::buffers::LogprobBuffers::new(&self.model.gpu, cfg, self.bufs.capacity));
        }
        let params = self.sampling.clone();
        self.rebuild_choose(&params, n)?;
        self.logprobs = n;
        self.last_logprobs = None;
        let below = self.fast_forward_below();
        if let Some(c) = &mut self.constraint {
            c.set_fast_forward(below);
        }
        // Every slot is free after the discard: resize them for the records.
        self.slots.clear();
        self.free_slots.clear();
        self.set_lookahead(self.lookahead);
        Ok(())
    }

    /// The log-probabilities of the last token returned (by
    /// [`feed`](Self::feed), [`next_token`](Self::next_token) or
    /// [`try_next_token`](Self::try_next_token)), when
    /// [`set_logprobs`](Self::set_logprobs) is on; `None` otherwise.
    pub fn last_logprobs(&self) -> Option<&TokenLogprobs> {
        self.last_logprobs.as_ref()
    }

    /// Bytes of one readback slot: the token, and the log-probability
    /// record when on.
    pub(super) fn readback_bytes(&self) -> usize {
        if self.logprobs > 0 {
            8 + 4 * LOGPROB_RECORD_WORDS as usize
        } else {
            8
        }
    }

    /// How tokens are chosen (see [`set_sampling`](Self::set_sampling)).
    pub fn sampling(&self) -> &SamplingParams {
        &self.sampling
    }
}
