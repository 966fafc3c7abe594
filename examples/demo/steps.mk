# `make demo`'s steps as the files they make, so that `make -j2` runs two at a time (one thread each) in the
# order their inputs allow, and a second demo re-trains nothing. Run by examples/demo/run.sh, which exports
# WORK, RAW, SYNTHETIC, USER_DIR, DEMO_START and BENCH_LIMIT. Each step is `examples/<method>/demo.sh STEP`;
# a method adds its steps here and its rows as bench/NN-name.json (the table lists them in name order).
W := $(WORK)
B := $(W)/bench
# Not named DATA: `make demo DATA=...` passes DATA down to this make, where it would override the file.
PREPARED := $(W)/data/prepare.json
BASELINE := $(W)/baseline/checkpoint_best.pt
ALIGNED := $(W)/align/lexical-table.txt
STEP = @bash examples/$(1)/demo.sh $(2)

# The longest chain first (data -> baseline -> blockwise heads), so that make starts it first.
all: $(B)/2-blockwise.json $(B)/1-baseline.json $(B)/7-bytenet.json $(B)/3-double_token.json \
     $(B)/4-lattice.json $(B)/5-rnn_fc-search.json $(B)/6-rnn_fc-int8-lists.json $(W)/baseline/generate.out
.PHONY: all
.DELETE_ON_ERROR:

# ---- the demo baseline: fairseq's transformer, small
$(PREPARED):
	$(call STEP,baseline,prepare)
$(BASELINE): $(PREPARED)
	$(call STEP,baseline,train)
$(W)/baseline/generate.out: $(BASELINE)
	$(call STEP,baseline,generate)
$(B)/1-baseline.json: $(BASELINE)
	$(call STEP,baseline,bench)

# ---- one alignment of the training text, for the lattice tables and rnn_fc's candidate lists
$(ALIGNED): $(PREPARED)
	@bash examples/demo/align.sh

# ---- blockwise: proposal heads on the frozen demo baseline
$(W)/blockwise/checkpoint_best.pt: $(BASELINE)
	$(call STEP,blockwise,train)
$(B)/2-blockwise.json: $(W)/blockwise/checkpoint_best.pt
	$(call STEP,blockwise,bench)

# ---- double-token: bidir-2 fine-tuned from the demo baseline, against the demo baseline
$(W)/double_token-bidir-2/checkpoint_best.pt: $(BASELINE)
	$(call STEP,double_token,train)
$(B)/3-double_token.json: $(W)/double_token-bidir-2/checkpoint_best.pt
	$(call STEP,double_token,bench)

# ---- sequence-to-lattice: candidate tables, a lattice scorer on the demo baseline's encoder, against the
#      demo baseline at beam 5
$(W)/lattice-table.pt: $(ALIGNED)
	$(call STEP,lattice,table)
$(W)/lattice/checkpoint_best.pt: $(BASELINE)
	$(call STEP,lattice,train)
$(B)/4-lattice.json: $(W)/lattice/checkpoint_best.pt $(W)/lattice-table.pt $(BASELINE)
	$(call STEP,lattice,bench)

# ---- rnn_fc's decoder on the demo baseline: its beam search, then int8 + candidate lists
$(W)/rnn_fc-list.pt: $(ALIGNED)
	$(call STEP,rnn_fc,lists)
$(B)/5-rnn_fc-search.json: $(BASELINE)
	$(call STEP,rnn_fc,bench-search)
$(B)/6-rnn_fc-int8-lists.json: $(BASELINE) $(W)/rnn_fc-list.pt
	$(call STEP,rnn_fc,bench-int8-lists)

# ---- ByteNet: character data of its own; cached decoding against fairseq's uncached path, same model
$(W)/bytenet/checkpoint_best.pt:
	$(call STEP,bytenet,train)
$(B)/7-bytenet.json: $(W)/bytenet/checkpoint_best.pt
	$(call STEP,bytenet,bench)
