"""A simulated wrist-camera gripper world (MuJoCo): recordings of scripted demonstrations, closed-loop rollouts.

- :mod:`~dpflow_core.sim.world`: the scene, the kinematic controller and the grasp rule;
- :mod:`~dpflow_core.sim.tasks`: ``pick_place`` and ``stack``, their initial states and success rules;
- :mod:`~dpflow_core.sim.demonstrator`: the scripted demonstrator;
- :mod:`~dpflow_core.sim.record`: demonstrations written as Matrix Studio recordings;
- :mod:`~dpflow_core.sim.rollout`: closed-loop rollouts of a policy and of the baselines.
"""
