"""Flags, YAML configs and their errors: each message names the flag and the fix."""

import pytest

from megatron_grpo.training.arguments import ConfigError, parse_args

DATA = ["--data-path", "data/x"]


def test_defaults_and_flag_override_yaml(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("num-layers: 6\nhidden_size: 256\nlr: 0.01\ngrpo: true\ngrpo-stable-interval: 7\n")
    cfg = parse_args(["--config", str(cfg_file), "--hidden-size", "64", *DATA])
    assert cfg.model.num_layers == 6          # from the file
    assert cfg.model.hidden_size == 64        # the explicit flag wins
    assert cfg.optimizer.lr == 0.01
    assert cfg.grpo.enabled is True and cfg.grpo.stable_interval == 7
    assert cfg.model.seq_length == 128        # dataclass default
    assert cfg.data.data_path == ["data/x"]


def test_help_lists_every_section(capsys):
    # argparse %-formats help strings: a docstring with a "%" sign once broke --help.
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--num-layers", "--grpo-stable-mode", "--grpo-offload {", "--grpo-offload-dir"):
        assert flag.split(" ")[0] in out
    assert "stable (20 %, local mode)" in " ".join(out.split())


def test_shipped_configs_parse():
    import glob

    files = sorted(glob.glob("launch/configs/*.yaml"))
    assert "launch/configs/tiny.yaml" in files and len(files) >= 5
    for f in files:
        parse_args(["--config", f, *DATA])


@pytest.mark.parametrize("argv, message", [
    (["--num-layer", "2"], "unknown flag(s): --num-layer"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], "--hidden-size (100) must be divisible by --num-attention-heads (3)"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive integer, got 0"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--lr must be > 0 and 0 <= --min-lr <= --lr"),
    (["--ffn-hidden-size", "-5"], "--ffn-hidden-size must be a positive integer, got -5"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be a positive integer, got 0"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be a positive integer, got 0"),
    (["--init-method-std", "0"], "--init-method-std must be > 0, got 0.0"),
    (["--init-method-std", "nan"], "--init-method-std must be > 0, got nan"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--adam-beta1", "1"], "--adam-beta1 must be in [0, 1), got 1.0"),
    (["--adam-beta2", "-0.5"], "--adam-beta2 must be in [0, 1), got -0.5"),
    (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**32 - 1], got -1"),
    (["--seed", "4294967296"], "--seed must be an integer in [0, 2**32 - 1], got 4294967296"),
    (["--split", "98,2"], "--split must be three non-negative numbers"),
    (["--save-interval", "10"], "--save-interval needs --save DIR"),
    (["--lr-decay-style", "step"], "--lr-decay-style must be cosine, linear or constant, got 'step'"),
    (["--load", "a", "--init-from", "b"], "--load (resume a run) and --init-from (start from weights) exclude each other"),
    (["--grpo-bucket-mb", "0"], "--grpo-bucket-mb must be a positive number of MB, got 0.0"),
    (["--grpo-retier-interval", "0"], "--grpo-retier-interval must be a positive integer, got 0"),
    (["--grpo-compressor", "int3"], "--grpo-compressor must be one of int4, int8, topk, powersgd, got 'int3'"),
    (["--grpo-core-share", "0.3"], "must sum to 1"),
    (["--grpo-stable-mode", "lazy"], "--grpo-stable-mode must be one of frozen, delayed, compressed, local, got 'lazy'"),
    (["--grpo", "--grpo-offload", "disk"], "--grpo-offload (OffloadConfig.target) must be one of none, cpu, ssd, got 'disk'"),
    (["--grpo", "--grpo-offload", "ssd"], "--grpo-offload-dir (OffloadConfig.offload_dir) must be a local directory with --grpo-offload ssd, got None"),
    (["--grpo-offload", "cpu"], "--grpo-offload cpu places GRPO's stable tier: it needs --grpo"),
    (["--grpo", "--grpo-offload", "cpu", "--grpo-offload-chunk-mb", "1.001"], "--grpo-offload-chunk-mb (OffloadConfig.chunk_mb) must be a whole multiple of 4096 bytes"),
    (["--grpo-gvr-min", "1.5"], "--grpo-gvr-min and --grpo-gvr-max must satisfy 0 < min < max"),
    (["--grpo-core-share", "-0.1", "--grpo-dynamic-share", "0.9"], "--grpo-core-share must be in [0, 1], got -0.1"),
    (["--grpo-warmup-iters", "-1"], "--grpo-warmup-iters must be an integer >= 0, got -1"),
    (["--grpo-importance-interval", "0"], "--grpo-importance-interval must be a positive integer, got 0"),
    (["--grpo-stable-interval", "-3"], "--grpo-stable-interval must be an integer >= 0 (0: never, the static-freeze ablation), got -3"),
    (["--grpo-gvr-interval", "0"], "--grpo-gvr-interval must be a positive integer, got 0"),
    (["--grpo-gvr-window", "0"], "--grpo-gvr-window must be a positive integer, got 0"),
    (["--grpo-compress-chunk", "0"], "--grpo-compress-chunk must be a positive integer, got 0"),
    (["--grpo-importance-decay", "1.0"], "--grpo-importance-decay must be in [0, 1), got 1.0"),
    (["--grpo-hysteresis", "1.5"], "--grpo-hysteresis must be in [0, 1), got 1.5"),
    (["--grpo-topk-ratio", "0"], "--grpo-topk-ratio must be in (0, 1], got 0.0"),
    (["--grpo-remediation-promote", "0"], "--grpo-remediation-promote must be in (0, 1], got 0.0"),
    (["--grpo-max-dynamic-share", "1.5"], "--grpo-max-dynamic-share must be in [0, 1], got 1.5"),
    (["--grpo-max-dynamic-share", "0.5"], "--grpo-dynamic-share (0.85) exceeds --grpo-max-dynamic-share (0.5)"),
])
def test_bad_flags_name_the_flag(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args([*argv, *DATA])
    assert message in str(err.value)


def test_layout_errors_need_world_size():
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by --tensor-model-parallel-size x "
                                          r"--pipeline-model-parallel-size = 2"):
        parse_args(["--tensor-model-parallel-size", "2", *DATA], world_size=3)
    with pytest.raises(ConfigError, match=r"--global-batch-size \(12\) must be a multiple of "
                                          r"--micro-batch-size x data-parallel size \(4 x 2\)"):
        parse_args(["--global-batch-size", "12", "--micro-batch-size", "4", *DATA], world_size=2)
    with pytest.raises(ConfigError, match=r"--num-layers \(3\) must be divisible by --pipeline-model-parallel-size \(2\)"):
        parse_args(["--num-layers", "3", "--pipeline-model-parallel-size", "2", *DATA], world_size=2)
    with pytest.raises(ConfigError, match=r"--num-distributed-optimizer-instances \(3\) must divide the "
                                          r"data-parallel size \(4 = world size 8 / \(TP x PP = 2\)\)"):
        parse_args(["--num-distributed-optimizer-instances", "3", "--tensor-model-parallel-size", "2",
                    "--global-batch-size", "16", *DATA], world_size=8)
    with pytest.raises(ConfigError, match=r"--num-distributed-optimizer-instances other than 1 .* needs "
                                          r"--use-distributed-optimizer"):
        parse_args(["--num-distributed-optimizer-instances", "2", "--no-use-distributed-optimizer", *DATA])
    assert parse_args(["--num-distributed-optimizer-instances", "2", "--global-batch-size", "16", *DATA],
                      world_size=4).parallel.num_distributed_optimizer_instances == 2


@pytest.mark.parametrize("world, tp, pp, per_node, expected", [
    (4, 1, 1, 2, 2), (16, 2, 1, 8, 2), (32, 2, 2, 8, 2), (8, 1, 1, 8, 1), (8, 1, 1, None, 1),
    (16, 1, 2, 8, 1),  # each stage fits in a node: nothing to split
])
def test_one_instance_per_node(world, tp, pp, per_node, expected):
    from megatron_grpo.training.model import instances_per_node

    assert instances_per_node(world, tp, pp, per_node) == expected


def test_one_instance_per_node_refuses_nodes_that_cut_a_tensor_parallel_group():
    from megatron_grpo.training.model import instances_per_node

    with pytest.raises(ValueError, match=r"one per node.*12 ranks do not split into whole nodes of 8 ranks"):
        instances_per_node(12, 1, 1, 8)
    with pytest.raises(ValueError, match=r"do not split into whole nodes of 2 ranks with TP 4"):
        instances_per_node(8, 4, 1, 2)


def test_missing_data_path_and_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="--data-path is required"):
        parse_args([])
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layerz: 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:1: unknown setting 'num_layerz' \(flag --num-layerz does not exist"):
        parse_args(["--config", str(bad), *DATA])
    wrong_type = tmp_path / "t.yaml"
    wrong_type.write_text("num-layers: two\n")
    with pytest.raises(ConfigError, match=r"'num-layers': expected int, got 'two'"):
        parse_args(["--config", str(wrong_type), *DATA])
    with pytest.raises(ConfigError, match="--config: file not found: nope.yaml"):
        parse_args(["--config", "nope.yaml", *DATA])


def test_broken_yaml_names_file_line_and_column_in_one_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("num-layers: 2\nhidden-size: 64\n  lr: 0.1\n")    # indented key: not a mapping
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(bad), *DATA])
    msg = str(err.value)
    assert "\n" not in msg
    assert msg == f"--config {bad}:3:5: not valid YAML: mapping values are not allowed here"
    # A problem found after the line that opened it names both.
    unclosed = tmp_path / "unclosed.yaml"
    unclosed.write_text("num-layers: 2\nsplit: [98, 2\nlr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(unclosed), *DATA])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--config {unclosed}:3:3: not valid YAML: ")
    assert "flow sequence that starts at line 2, column 8" in msg


@pytest.mark.parametrize("argv, message", [
    (["--num-layer", "2"], "unknown flag(s): --num-layer 2; did you mean --num-layers? "
                           "(see --help for accepted flags)"),
    (["--grpo-stabel-interval", "3"], "did you mean --grpo-stable-interval?"),
    (["--hiden-size=64"], "unknown flag(s): --hiden-size=64; did you mean --hidden-size?"),
    (["--no-grp"], "did you mean --no-grpo?"),
    (["--num-layer", "2", "--lrr", "0.1"], "did you mean --num-layers for --num-layer, --lr for --lrr?"),
    (["--xyzzy"], "unknown flag(s): --xyzzy (see --help for accepted flags)"),   # nothing close
])
def test_unknown_flag_suggests_the_closest(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args([*argv, *DATA])
    assert message in str(err.value)


def test_unknown_yaml_key_suggests_the_closest_in_the_files_spelling(tmp_path):
    cases = {"hiden-size: 64\n": "'hiden-size' (flag --hiden-size does not exist; did you mean 'hidden-size'?",
             "lr: 0.1\ngrpo_stabel_interval: 3\n": "'grpo_stabel_interval' (flag --grpo-stabel-interval does "
                                                  "not exist; did you mean 'grpo_stable_interval'?",
             "zzzzqq: 1\n": "'zzzzqq' (flag --zzzzqq does not exist; see --help)"}
    for i, (text, message) in enumerate(cases.items()):
        f = tmp_path / f"k{i}.yaml"
        f.write_text(text)
        with pytest.raises(ConfigError) as err:
            parse_args(["--config", str(f), *DATA])
        line = text.count("\n")   # the unknown key is on the last line
        assert f"--config {f}:{line}: unknown setting {message}" in str(err.value)
    wrong_type = tmp_path / "t.yaml"
    wrong_type.write_text("seed: 1\nnum-layers: two\n")
    with pytest.raises(ConfigError, match=r"t.yaml:2: 'num-layers': expected int, got 'two'"):
        parse_args(["--config", str(wrong_type), *DATA])


def test_range_edges_are_accepted():
    cfg = parse_args(["--seed", "0", "--weight-decay", "0", "--adam-beta1", "0", "--adam-beta2", "0.999",
                      "--ffn-hidden-size", "1", "--ddp-bucket-size", "1", "--lr-decay-iters", "1", *DATA])
    assert (cfg.training.seed, cfg.optimizer.weight_decay, cfg.model.ffn_hidden_size) == (0, 0.0, 1)
    assert parse_args(["--seed", str(2**32 - 1), *DATA]).training.seed == 2**32 - 1


def test_yaml_str_fields_refuse_mappings_lists_and_booleans(tmp_path):
    for i, (text, shown) in enumerate([("save: {a: 1}", "{'a': 1}"), ("run-name: [x, y]", "['x', 'y']"),
                                       ("metrics_file: true", "True")]):
        f = tmp_path / f"s{i}.yaml"
        f.write_text(f"seed: 1\n{text}\n")
        key = text.split(":")[0]
        with pytest.raises(ConfigError) as err:
            parse_args(["--config", str(f), *DATA])
        assert str(err.value) == f"--config {f}:2: '{key}': expected str, got {shown}"
    # Numbers are scalars written as text: a run named 2024, the weights of a data-path list.
    ok = tmp_path / "ok.yaml"
    ok.write_text("run-name: 2024\ndata-path: [0.3, a, 0.7, b]\n")
    cfg = parse_args(["--config", str(ok)])
    assert cfg.logging.run_name == "2024" and cfg.data.data_path == ["0.3", "a", "0.7", "b"]


def test_a_bad_pipeline_layout_is_refused_by_name():
    # megatron checks the layout with bare asserts inside the model build; parse_args checks it
    # with megatron's own parser first and names the flag.
    base = ["--num-layers", "2", "--pipeline-model-parallel-size", "2", *DATA]
    cfg = parse_args([*base, "--pipeline-model-parallel-layout", "E|t*2,L"])
    assert cfg.parallel.pipeline_model_parallel_layout == "E|t*2,L"
    with pytest.raises(ConfigError, match=r"'E\|t\|t\|L' has 4 stages; --pipeline-model-parallel-size is 2"):
        parse_args([*base, "--pipeline-model-parallel-layout", "E|t|t|L"])
    with pytest.raises(ConfigError, match=r"Number of decoder layers 3.*--num-layers 2 of them"):
        parse_args([*base, "--pipeline-model-parallel-layout", "E|t*3,L"])
    with pytest.raises(ConfigError, match=r"Invalid layer character: x"):
        parse_args([*base, "--pipeline-model-parallel-layout", "E|tx,L"])
    # Without a layout the layers must still split evenly.
    with pytest.raises(ConfigError, match=r"--num-layers \(3\) must be divisible"):
        parse_args(["--num-layers", "3", "--pipeline-model-parallel-size", "2", *DATA])
