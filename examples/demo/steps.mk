# `make demo`'s steps as the files they make, so that `make -j2` runs two at a time (one thread each) in the
# order their inputs allow, and a second demo re-trains nothing. Run by examples/demo/run.sh, which exports
# WORK, RAW, SYNTHETIC, USER_DIR, DEMO_START and BENCH_LIMIT. Each step is `examples/<method>/demo.sh STEP`;
# a method adds its steps here and its rows as bench/N-name.json (the table lists them in name order).
W := $(WORK)
B := $(W)/bench
# Not named DATA: `make demo DATA=...` passes DATA down to this make, where it would override the file.
PREPARED := $(W)/data/prepare.json
BASELINE := $(W)/baseline/checkpoint_best.pt
ALIGNED := $(W)/align/lexical-table.txt
STEP = @bash examples/$(1)/demo.sh $(2)

# The longest chain first (data -> baseline -> the trainings warm-started from it), so that make starts it first;
# then what needs neither (ByteNet, the alignment), which runs on the other core while the baseline trains.
all: $(B)/4-blockwise.json $(B)/5-double_token.json $(B)/6-lattice.json $(W)/baseline/bleu.txt \
     $(B)/1-fast_step-fp32.json $(B)/2-fast_step-int8.json $(B)/7-rnn_fc.json $(B)/8-bytenet.json
.PHONY: all
.DELETE_ON_ERROR:

# ---- the demo baseline: fairseq's transformer, small; its whole test set at beam 5 (fairseq-generate)
$(PREPARED):
	$(call STEP,baseline,prepare)
$(BASELINE): $(PREPARED)
	$(call STEP,baseline,train)
$(W)/baseline/bleu.txt: $(BASELINE)
	$(call STEP,baseline,generate)

# ---- the fast decoder step on the demo baseline, greedy: fp32 (stock outputs) and int8
$(B)/1-fast_step-fp32.json: $(BASELINE)
	$(call STEP,fast_step,bench-fp32)
$(B)/2-fast_step-int8.json: $(BASELINE)
	$(call STEP,fast_step,bench-int8)

# ---- one alignment of the training text, for the lattice tables and rnn_fc's candidate lists
$(ALIGNED): $(PREPARED)
	@bash examples/demo/align.sh

# ---- blockwise: proposal heads on the frozen demo baseline, decoded on the fast step
$(W)/blockwise/checkpoint_best.pt: $(BASELINE)
	$(call STEP,blockwise,train)
$(B)/4-blockwise.json: $(W)/blockwise/checkpoint_best.pt
	$(call STEP,blockwise,bench)

# ---- double-token: bidir-2 fine-tuned from the demo baseline, on the fast step, against the demo baseline
$(W)/double_token-bidir-2/checkpoint_best.pt: $(BASELINE)
	$(call STEP,double_token,train)
$(B)/5-double_token.json: $(W)/double_token-bidir-2/checkpoint_best.pt
	$(call STEP,double_token,bench)

# ---- sequence-to-lattice: candidate tables, a lattice scorer on the demo baseline's encoder, against the
#      demo baseline at beam 5
$(W)/lattice-table.pt: $(ALIGNED)
	$(call STEP,lattice,table)
$(W)/lattice/checkpoint_best.pt: $(BASELINE)
	$(call STEP,lattice,train)
$(B)/6-lattice.json: $(W)/lattice/checkpoint_best.pt $(W)/lattice-table.pt $(BASELINE)
	$(call STEP,lattice,bench)

# ---- rnn_fc's decoder speedups on the demo baseline: int8, candidate lists, early stopping
$(W)/rnn_fc-list.pt: $(ALIGNED)
	$(call STEP,rnn_fc,lists)
$(B)/7-rnn_fc.json: $(BASELINE) $(W)/rnn_fc-list.pt
	$(call STEP,rnn_fc,bench)

# ---- ByteNet: character data of its own; cached decoding against fairseq's uncached path, same model
$(W)/bytenet/checkpoint_best.pt:
	$(call STEP,bytenet,train)
$(B)/8-bytenet.json: $(W)/bytenet/checkpoint_best.pt
	$(call STEP,bytenet,bench)
