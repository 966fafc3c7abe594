"""The benchmark harness: a method's generator against fairseq's stock generator, same model, same run."""
